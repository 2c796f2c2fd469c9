//! The fields of an OpenAI request body that routing needs, read in one validating pass.
//!
//! The body is parsed once with borrowed [`RawValue`]s: every other field is skipped by serde
//! without being materialised, and the byte spans of the fields the gateway may rewrite (`model`,
//! `stream_options`) are kept so that [`super::edit`] can splice them without re-serialising the
//! rest. serde_json validates UTF-8, rejects duplicate routed fields and caps nesting depth (128),
//! so hostile bodies end here with a 400, never a panic.

use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::ApiError;

/// The member that holds an OpenAI request's prompt; which one is each client API's answer
/// (`api::ClientApi::parse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PromptField {
    /// `messages` (chat completions): an array of `{role, content}` objects.
    Messages,
    /// `prompt` (completions): a string or an array.
    Prompt,
    /// `input` (embeddings): a string or an array.
    Input,
}

/// Largest `max_tokens` accepted; anything above is a client error, not a backend's problem.
pub const MAX_TOKENS_LIMIT: u64 = 16 * 1024 * 1024;
/// Deepest nesting of arrays and objects accepted anywhere in a body (serde_json enforces 128
/// on the fields it reads, but skips ignored fields without a limit; backends may not).
pub const MAX_DEPTH: usize = 128;
/// Largest `n` accepted.
pub const MAX_N: u64 = 128;
/// Chat overhead per message in the tokenizer-free estimate (role markers and separators).
const TOKENS_PER_MESSAGE: u64 = 4;
/// Tokens that prime the reply.
const REPLY_PRIMING_TOKENS: u64 = 3;

/// What the gateway knows about a request before choosing a backend.
#[derive(Debug, Clone)]
pub struct RequestFields {
    /// Where the prompt was read from.
    pub prompt_field: PromptField,
    pub model: String,
    /// Byte span of the `model` value (quotes included) in the body.
    pub model_span: Range<usize>,
    pub stream: bool,
    /// The client's `stream_options.include_usage`, when it sent one.
    pub include_usage: Option<bool>,
    /// Byte span of the `stream_options` value, when present.
    pub stream_options_span: Option<Range<usize>>,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u64>,
    pub n: u64,
    /// Tokenizer-free estimate of the prompt: content bytes / 4 plus per-message overhead.
    pub prompt_tokens_estimate: u64,
    /// Stable 64-bit hash of the conversation prefix (everything but the last message, or the
    /// first KiB of a single prompt), for prefix-affinity routing. Stable across processes.
    pub prefix_hash: Option<u64>,
    /// Tokenizer-free estimate (bytes / 4 plus per-message overhead) of the part of the prompt
    /// that `prefix_hash` stands for: the tokens a backend with this prefix cached would not
    /// prefill again.
    pub prefix_tokens_estimate: u64,
    /// Byte span of the prompt's value in the body: `messages` (chat), `prompt` (completions)
    /// or `input` (embeddings); what an exact count sends to a backend's tokenizer.
    pub prompt_span: Range<usize>,
    /// Byte offset just after the body's opening `{`, where a new member can be inserted.
    pub object_start: usize,
    /// Whether the body's object has at least one member (always true once `model` is known).
    pub has_members: bool,
}

#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    /// Kept even when `null` (plain `Option` would turn it into `None` and lose its span, and
    /// the usage splice would then add a second `stream_options` key).
    #[serde(borrow, default, deserialize_with = "present")]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    n: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
}

/// A present field as `Some`, `null` included.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(d).map(Some)
}

#[derive(Deserialize)]
struct MessageWire<'a> {
    #[serde(borrow)]
    role: Option<&'a RawValue>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct StreamOptionsWire {
    include_usage: Option<serde_json::Value>,
}

const ROLES: &[&str] = &[
    "system",
    "user",
    "assistant",
    "tool",
    "function",
    "developer",
];

/// Parse and validate the routed fields of `body`, its prompt in `prompt_field`.
pub fn parse(prompt_field: PromptField, body: &[u8]) -> Result<RequestFields, ApiError> {
    let trimmed_start = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .ok_or_else(|| {
            ApiError::bad_request("The request body is empty; expected a JSON object.")
        })?;
    if body[trimmed_start] != b'{' {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    }
    if nesting_depth(body) > MAX_DEPTH {
        return Err(ApiError::bad_request(format!(
            "The request body is nested more than {MAX_DEPTH} levels deep."
        ))
        .with_code("invalid_json"));
    }
    let wire: Wire<'_> = serde_json::from_slice(body).map_err(ApiError::invalid_json)?;

    let model_raw = wire.model.ok_or_else(|| {
        ApiError::bad_request("you must provide a model parameter").with_param("model")
    })?;
    let model: String = match serde_json::from_str::<serde_json::Value>(model_raw.get()) {
        Ok(serde_json::Value::String(s)) if !s.is_empty() => s,
        Ok(serde_json::Value::String(_)) => {
            return Err(ApiError::bad_request("`model` must not be empty.").with_param("model"))
        }
        _ => return Err(ApiError::bad_request("`model` must be a string.").with_param("model")),
    };
    let model_span = span_of(body, model_raw);

    let stream = match wire.stream {
        None => false,
        Some(raw) => match raw.get() {
            "true" => true,
            "false" | "null" => false,
            _ => {
                return Err(
                    ApiError::bad_request("`stream` must be a boolean.").with_param("stream")
                )
            }
        },
    };

    let (include_usage, stream_options_span) = match wire.stream_options {
        None => (None, None),
        Some(raw) if raw.get() == "null" => (None, Some(span_of(body, raw))),
        Some(raw) => {
            let opts: StreamOptionsWire = serde_json::from_str(raw.get()).map_err(|_| {
                ApiError::bad_request("`stream_options` must be an object.")
                    .with_param("stream_options")
            })?;
            let include = match opts.include_usage {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::Bool(b)) => Some(b),
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "`stream_options.include_usage` must be a boolean.",
                    )
                    .with_param("stream_options.include_usage"))
                }
            };
            (include, Some(span_of(body, raw)))
        }
    };

    let max_completion = non_negative(wire.max_completion_tokens, "max_completion_tokens")?;
    let max_tokens_field = non_negative(wire.max_tokens, "max_tokens")?;
    let max_tokens = max_completion.or(max_tokens_field);
    for (value, name) in [
        (max_completion, "max_completion_tokens"),
        (max_tokens_field, "max_tokens"),
    ] {
        if let Some(m) = value.filter(|m| *m > MAX_TOKENS_LIMIT) {
            return Err(ApiError::bad_request(format!(
                "`{name}` of {m} is beyond any model's context; the limit is {MAX_TOKENS_LIMIT}."
            ))
            .with_param(name));
        }
    }
    let n = match non_negative(wire.n, "n")? {
        None => 1,
        Some(0) => return Err(ApiError::bad_request("`n` must be at least 1.").with_param("n")),
        Some(n) if n > MAX_N => {
            return Err(
                ApiError::bad_request(format!("`n` must be at most {MAX_N}.")).with_param("n"),
            )
        }
        Some(n) => n,
    };

    let (prompt_tokens_estimate, prefix_hash, prefix_tokens_estimate, prompt_span) =
        match prompt_field {
            PromptField::Messages => {
                let raw = wire.messages.ok_or_else(|| {
                    ApiError::bad_request("`messages` is required.").with_param("messages")
                })?;
                let (est, hash, prefix) = estimate_messages(raw)?;
                (est, hash, prefix, span_of(body, raw))
            }
            PromptField::Prompt => {
                let raw = wire.prompt.ok_or_else(|| {
                    ApiError::bad_request("`prompt` is required.").with_param("prompt")
                })?;
                string_or_array(raw, "prompt")?;
                let est = estimate_raw(raw);
                let prefix = (raw.get().len().min(PREFIX_BYTES) as u64).div_ceil(4);
                (
                    est,
                    Some(prefix_of(raw.get().as_bytes())),
                    prefix,
                    span_of(body, raw),
                )
            }
            PromptField::Input => {
                let raw = wire.input.ok_or_else(|| {
                    ApiError::bad_request("`input` is required.").with_param("input")
                })?;
                string_or_array(raw, "input")?;
                (estimate_raw(raw), None, 0, span_of(body, raw))
            }
        };

    Ok(RequestFields {
        prompt_field,
        model,
        model_span,
        stream,
        include_usage,
        stream_options_span,
        max_tokens,
        n,
        prompt_tokens_estimate,
        prefix_hash,
        prefix_tokens_estimate,
        prompt_span,
        object_start: trimmed_start + 1,
        has_members: true,
    })
}

/// The deepest nesting of `[`/`{` outside strings (stops counting once past the limit).
pub fn nesting_depth(body: &[u8]) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    max = depth;
                    if max > MAX_DEPTH {
                        return max;
                    }
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// The byte span of a borrowed raw value inside `body`.
fn span_of(body: &[u8], raw: &RawValue) -> Range<usize> {
    let start = (raw.get().as_ptr() as usize).saturating_sub(body.as_ptr() as usize);
    let end = start + raw.get().len();
    debug_assert!(end <= body.len());
    start..end.min(body.len())
}

fn non_negative(raw: Option<&RawValue>, name: &str) -> Result<Option<u64>, ApiError> {
    let Some(raw) = raw else { return Ok(None) };
    let text = raw.get();
    if text == "null" {
        return Ok(None);
    }
    match text.parse::<u64>() {
        Ok(v) => Ok(Some(v)),
        Err(_) => Err(ApiError::bad_request(format!(
            "`{name}` must be a non-negative integer, got {}.",
            clip(text)
        ))
        .with_param(name)),
    }
}

/// `prompt` and `input` are a string or an array (of strings, token ids or arrays of token
/// ids); the elements are the backend's to check.
fn string_or_array(raw: &RawValue, name: &str) -> Result<(), ApiError> {
    match raw.get().as_bytes().first() {
        Some(b'"') | Some(b'[') => Ok(()),
        _ => Err(ApiError::bad_request(format!(
            "`{name}` must be a string or an array, got {}.",
            clip(raw.get())
        ))
        .with_param(name)),
    }
}

fn clip(s: &str) -> &str {
    let mut end = s.len().min(32);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn estimate_raw(raw: &RawValue) -> u64 {
    (raw.get().len() as u64).div_ceil(4)
}

/// How much of a single prompt stands for its shared part (prefix hash and prefix estimate).
const PREFIX_BYTES: usize = 1024;

/// Prompt estimate, prefix hash and prefix estimate of a `messages` array.
fn estimate_messages(raw: &RawValue) -> Result<(u64, Option<u64>, u64), ApiError> {
    let messages: Vec<MessageWire<'_>> = serde_json::from_str(raw.get()).map_err(|_| {
        ApiError::bad_request("`messages` must be an array of message objects.")
            .with_param("messages")
    })?;
    if messages.is_empty() {
        return Err(
            ApiError::bad_request("`messages` must contain at least one message.")
                .with_param("messages"),
        );
    }
    let mut tokens = REPLY_PRIMING_TOKENS;
    let mut prefix = Fnv64::new();
    let mut prefix_tokens = 0u64;
    let last = messages.len() - 1;
    for (i, m) in messages.iter().enumerate() {
        let role = m.role.map(RawValue::get).unwrap_or("");
        let role_ok = role.len() >= 2
            && role.starts_with('"')
            && role.ends_with('"')
            && ROLES.contains(&&role[1..role.len() - 1]);
        if !role_ok {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].role must be one of {}.",
                ROLES.join(", ")
            ))
            .with_param(format!("messages[{i}].role")));
        }
        let content_len = m.content.map(|c| c.get().len()).unwrap_or(0) as u64;
        tokens += TOKENS_PER_MESSAGE + content_len.div_ceil(4);
        if i < last || last == 0 {
            prefix.write(role.as_bytes());
            if let Some(c) = m.content {
                let bytes = c.get().as_bytes();
                // A single message: its first KiB stands for the shared part (system-like text).
                let take = if last == 0 {
                    bytes.len().min(PREFIX_BYTES)
                } else {
                    bytes.len()
                };
                prefix.write(&bytes[..take]);
                prefix_tokens += (take as u64).div_ceil(4);
            }
            prefix_tokens += TOKENS_PER_MESSAGE;
        }
    }
    Ok((tokens, Some(prefix.finish()), prefix_tokens.min(tokens)))
}

fn prefix_of(bytes: &[u8]) -> u64 {
    let mut h = Fnv64::new();
    h.write(&bytes[..bytes.len().min(PREFIX_BYTES)]);
    h.finish()
}

/// FNV-1a, 64 bit: tiny, and the same in every process and every build (unlike `DefaultHasher`),
/// so gateway replicas agree on affinity without sharing state.
pub struct Fnv64(u64);

impl Fnv64 {
    pub fn new() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
    pub fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv64 {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<RequestFields, ApiError> {
        parse(PromptField::Messages, body.as_bytes())
    }

    #[test]
    fn reads_routed_fields_and_spans() {
        let body = r#"{"model":"llama3","stream":true,"max_tokens":10,"messages":[{"role":"user","content":"hello there"}]}"#;
        let f = chat(body).unwrap();
        assert_eq!(f.model, "llama3");
        assert_eq!(&body[f.model_span.clone()], "\"llama3\"");
        assert!(f.stream);
        assert_eq!(f.max_tokens, Some(10));
        assert_eq!(f.n, 1);
        assert!(f.prompt_tokens_estimate >= 3 + 4 + 3);
        assert_eq!(f.include_usage, None);
    }

    #[test]
    fn max_completion_tokens_wins() {
        let f = chat(r#"{"model":"m","max_tokens":5,"max_completion_tokens":7,"messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert_eq!(f.max_tokens, Some(7));
    }

    #[test]
    fn stream_options_parsed() {
        let body = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"x"}]}"#;
        let f = chat(body).unwrap();
        assert_eq!(f.include_usage, Some(true));
        assert_eq!(
            &body[f.stream_options_span.unwrap()],
            r#"{"include_usage":true}"#
        );
    }

    #[test]
    fn rejects_bad_input() {
        let cases = [
            ("", "empty"),
            ("[1,2]", "JSON object"),
            ("{\"model\":", "parse"),
            (r#"{"messages":[]}"#, "model parameter"),
            (r#"{"model":5,"messages":[]}"#, "must be a string"),
            (r#"{"model":"","messages":[]}"#, "must not be empty"),
            (
                r#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}"#,
                "boolean",
            ),
            (
                r#"{"model":"m","max_tokens":-1,"messages":[{"role":"user","content":"x"}]}"#,
                "non-negative",
            ),
            (
                r#"{"model":"m","max_tokens":1.5,"messages":[{"role":"user","content":"x"}]}"#,
                "non-negative",
            ),
            (
                r#"{"model":"m","max_tokens":1e30,"messages":[{"role":"user","content":"x"}]}"#,
                "non-negative",
            ),
            (
                r#"{"model":"m","max_tokens":99999999999,"messages":[{"role":"user","content":"x"}]}"#,
                "beyond",
            ),
            (
                r#"{"model":"m","n":0,"messages":[{"role":"user","content":"x"}]}"#,
                "at least 1",
            ),
            (r#"{"model":"m"}"#, "messages"),
            (r#"{"model":"m","messages":"hi"}"#, "array"),
            (r#"{"model":"m","messages":[]}"#, "at least one"),
            (
                r#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#,
                "role",
            ),
            (
                r#"{"model":"a","model":"b","messages":[{"role":"user","content":"x"}]}"#,
                "duplicate",
            ),
        ];
        for (body, needle) in cases {
            let err = chat(body).unwrap_err();
            assert_eq!(err.status, 400, "{body}");
            assert!(err.message.contains(needle), "{body}: {}", err.message);
        }
    }

    #[test]
    fn deep_nesting_is_a_400_not_a_stack_overflow() {
        let deep = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"x":{}{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(chat(&deep).unwrap_err().status, 400);
        // Brackets inside strings do not count; 128 levels are fine.
        let ok = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{}\\\"]"}}],"x":{}{}}}"#,
            "[".repeat(1000),
            "[".repeat(120),
            "]".repeat(120)
        );
        assert!(chat(&ok).is_ok());
    }

    #[test]
    fn invalid_utf8_is_a_400() {
        let mut body = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
        body.extend_from_slice(&[0xff, 0xfe]);
        body.extend_from_slice(br#""}]}"#);
        assert_eq!(parse(PromptField::Messages, &body).unwrap_err().status, 400);
    }

    #[test]
    fn prefix_hash_ignores_last_message_and_is_stable() {
        let a = chat(r#"{"model":"m","messages":[{"role":"system","content":"You are helpful"},{"role":"user","content":"q1"}]}"#).unwrap();
        let b = chat(r#"{"model":"m","messages":[{"role":"system","content":"You are helpful"},{"role":"user","content":"q2"}]}"#).unwrap();
        let c = chat(r#"{"model":"m","messages":[{"role":"system","content":"Other"},{"role":"user","content":"q1"}]}"#).unwrap();
        assert_eq!(a.prefix_hash, b.prefix_hash);
        assert_ne!(a.prefix_hash, c.prefix_hash);
        // the prefix estimate covers the system message ("You are helpful" with its quotes:
        // 17 bytes -> 5 tokens, + 4 per message), not the last one
        assert_eq!(a.prefix_tokens_estimate, 9);
        assert!(a.prefix_tokens_estimate < a.prompt_tokens_estimate);
        let mut h = Fnv64::new();
        h.write(b"a");
        assert_eq!(h.finish(), 0xaf63dc4c8601ec8c);
    }

    #[test]
    fn completions_and_embeddings() {
        let f = parse(PromptField::Prompt, br#"{"model":"m","prompt":"abcdabcd"}"#).unwrap();
        assert_eq!(f.prompt_tokens_estimate, 3);
        // (its expected output, none: `api::embeddings`'s tests)
        parse(PromptField::Input, br#"{"model":"m","input":["a","b"]}"#).unwrap();
        assert!(parse(PromptField::Input, br#"{"model":"m"}"#).is_err());
    }
}
