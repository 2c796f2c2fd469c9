//! A model's own tokenizer and chat template, read from its folder on disk, computing the
//! prompt token ids a vLLM 0.32 engine computes for the same request, token for token.
//!
//! What it owns:
//! - loading a tokenizer folder ([`folder`]): `tokenizer.json`, the chat templates
//!   (`chat_template.jinja`, or `tokenizer_config.json`'s `chat_template`) and the special
//!   tokens; nothing is ever downloaded;
//! - the chat path ([`Tokenizer::chat_ids`]): the request's messages and tools normalised as
//!   vLLM normalises them ([`conversation`]), the template rendered as transformers renders it
//!   ([`template`]), then the text encoded **without** special tokens (the template writes
//!   them; a request may ask for them with `add_special_tokens: true`);
//! - the completions path ([`Tokenizer::prompt_ids`]): the prompt encoded **with** special
//!   tokens (the BOS a post-processor adds, as vLLM's completions and `/tokenize` do), unless
//!   the request turns them off;
//! - encoding ([`encode`], [`split`]): the tokenizer's own pipeline, or for byte-level BPE
//!   tokenizers a direct path that gives the same ids about fifteen times faster.
//!
//! Invariants:
//! - No panic on request input: a body the engine would refuse, or one this module cannot
//!   tokenize exactly (images, a request-supplied template), is a [`TokenizerError`], never a
//!   guess.
//! - Everything that does not depend on the request (the tokenizer, the compiled templates and
//!   what is read from them) is built once, at [`Tokenizer::load`]; a [`Tokenizer`] is
//!   `Send + Sync` and shared in an `Arc`, its only changing state the encoder's bounded
//!   cache of words' ids.
//! - A render is bounded in work (the template engine's fuel), so a hostile template or
//!   request cannot hold a thread.
//!
//! Known limits: templates render the date of `strftime_now` in UTC; a model whose
//! `tokenizer_config.json` names a model-specific tokenizer class that transformers rebuilds
//! from the vocabulary (rather than using `tokenizer.json` as it is) may differ; multimodal
//! content and vLLM's `--chat-template` override are not supported.

mod content_format;
mod conversation;
mod encode;
mod folder;
mod pyjson;
mod split;
mod strftime;
mod template;

use std::fmt;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use minijinja::Value;

use conversation::ChatRequest;
use encode::Encoder;
use folder::{Folder, Specials};
use template::{Chosen, Templates};

/// Why a folder could not be loaded or a request could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file or folder cannot be read.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file is there but wrong (malformed JSON, not a tokenizer, a template syntax error).
    #[error("{}: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
    /// The request is not one the engine would tokenize (or not one this module can).
    #[error("request: {0}")]
    Request(String),
    /// The model has no chat template, so it cannot take chat requests.
    #[error("the model has no chat template")]
    NoTemplate,
    /// The chat template refused the request (`raise_exception`) or failed on it.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed on the text.
    #[error("encode: {0}")]
    Encode(String),
}

/// A model's tokenizer and chat templates, loaded once (see the module doc).
pub struct Tokenizer {
    dir: PathBuf,
    encoder: Encoder,
    templates: Templates,
    specials: Specials,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer").field("dir", &self.dir).finish()
    }
}

/// transformers marks the end of the message to continue with this, then cuts the rendered
/// text there.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

impl Tokenizer {
    /// Loads the tokenizer folder `dir` (see [`folder`] for what it reads).
    pub fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let Folder {
            encoder,
            templates: sources,
            specials,
        } = Folder::read(dir)?;
        let mut templates = Templates::new().map_err(|reason| TokenizerError::Invalid {
            path: dir.to_path_buf(),
            reason,
        })?;
        for (name, source, path) in sources {
            templates
                .add(&name, source)
                .map_err(|reason| TokenizerError::Invalid { path, reason })?;
        }
        if !templates.is_empty() && !templates.has_default() {
            return Err(TokenizerError::Invalid {
                path: dir.to_path_buf(),
                reason: "several chat templates and none named \"default\"".into(),
            });
        }
        Ok(Tokenizer {
            dir: dir.to_path_buf(),
            encoder,
            templates,
            specials,
        })
    }

    /// The folder this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The prompt token ids of an OpenAI chat-completions request body (`messages`, `tools`,
    /// `add_generation_prompt` (default true), `continue_final_message`,
    /// `chat_template_kwargs`, `add_special_tokens`, `documents`, `reasoning_effort`).
    ///
    /// The raw body is taken rather than parsed JSON because the order of its keys can reach
    /// the prompt (a template printing a tool's parameters as JSON keeps the request's order).
    pub fn chat_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokenizerError> {
        let (text, add_special) = self.chat_text(body)?;
        self.encode(&text, add_special)
    }

    /// The token ids of a completions prompt. vLLM adds the special tokens the tokenizer's
    /// post-processor adds (a BOS) unless the request says `add_special_tokens: false`, so a
    /// caller passes that field, `true` when absent.
    pub fn prompt_ids(
        &self,
        prompt: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode(prompt, add_special_tokens)
    }

    /// Each id's token as the vocabulary spells it (`None` for an id it does not have), as
    /// vLLM's `/tokenize` returns them in `token_strs`.
    pub fn token_strs(&self, ids: &[u32]) -> Vec<Option<String>> {
        ids.iter().map(|id| self.encoder.id_to_token(*id)).collect()
    }

    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encoder
            .encode(text, add_special)
            .map_err(TokenizerError::Encode)
    }

    /// The rendered prompt of a chat request and whether special tokens are added to it.
    fn chat_text(&self, body: &[u8]) -> Result<(String, bool), TokenizerError> {
        let request = ChatRequest::parse(body).map_err(TokenizerError::Request)?;
        let tools = request.tools().map_err(TokenizerError::Request)?;
        let chosen = self
            .templates
            .choose(tools.is_some())
            .ok_or(TokenizerError::NoTemplate)?;
        let mut messages = request
            .conversation(chosen.format)
            .map_err(TokenizerError::Request)?;
        if !chosen.knows_developer {
            messages = conversation::developer_as_system(messages);
        }
        let continued = if request.continue_final_message() {
            Some(mark_final_message(&mut messages, chosen)?)
        } else {
            None
        };
        let context = self.context(&request, messages, tools)?;
        let rendered = self
            .templates
            .render(chosen, context)
            .map_err(TokenizerError::Template)?;
        let text = match continued {
            Some(final_text) => cut_at_mark(rendered, &final_text)?,
            None => rendered,
        };
        Ok((text, request.add_special_tokens()))
    }

    /// The template's variables: `messages`, `tools`, `documents`, `add_generation_prompt`,
    /// the special tokens, then the request's extra variables (which win).
    fn context(
        &self,
        request: &ChatRequest,
        messages: Vec<Value>,
        tools: Option<Value>,
    ) -> Result<Value, TokenizerError> {
        let mut ctx: IndexMap<Value, Value> = IndexMap::new();
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert("tools".into(), tools.unwrap_or(Value::from(())));
        let documents = request.documents().map_err(TokenizerError::Request)?;
        ctx.insert("documents".into(), documents);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(request.add_generation_prompt()),
        );
        for (name, token) in self.specials.named() {
            ctx.insert(name.into(), Value::from(token));
        }
        let kwargs = request.template_kwargs().map_err(TokenizerError::Request)?;
        for (name, value) in kwargs {
            ctx.insert(Value::from(name), value);
        }
        Ok(Value::from(ctx))
    }
}

/// transformers' `continue_final_message`: the last message's (last) text gets
/// [`CONTINUE_TAG`] appended before rendering; returns that text as it was.
fn mark_final_message(
    messages: &mut [Value],
    chosen: Chosen<'_>,
) -> Result<String, TokenizerError> {
    let refuse = |why: &str| TokenizerError::Request(format!("continue_final_message: {why}"));
    let last = messages.last_mut().ok_or_else(|| refuse("no messages"))?;
    let content = conversation::get(last, "content")
        .filter(|c| !c.is_none())
        .ok_or_else(|| refuse("the final message has no content to continue"))?;
    if !chosen.mentions_content {
        return Err(refuse("the chat template does not use `content`"));
    }
    let (original, marked) = match content.as_str() {
        Some(text) => (
            text.to_owned(),
            Value::from(format!("{text}{CONTINUE_TAG}")),
        ),
        None => mark_last_text_part(&content).ok_or_else(|| refuse("no text to continue"))?,
    };
    *last = replaced(last, "content", marked);
    Ok(original)
}

/// The last part with a `text` in a list of parts, and the list with that text marked.
fn mark_last_text_part(parts: &Value) -> Option<(String, Value)> {
    let mut items: Vec<Value> = parts.try_iter().ok()?.collect();
    let (index, text) = items.iter().enumerate().rev().find_map(|(i, p)| {
        let text = conversation::get(p, "text")?;
        Some((i, text.as_str()?.to_owned()))
    })?;
    let marked = Value::from(format!("{text}{CONTINUE_TAG}"));
    let part = items.get_mut(index)?;
    *part = replaced(part, "text", marked);
    Some((text, Value::from(items)))
}

/// A copy of map `m` with `key` set to `value` (in its place).
fn replaced(m: &Value, key: &str, value: Value) -> Value {
    let mut out: IndexMap<Value, Value> = IndexMap::new();
    if let Ok(keys) = m.try_iter() {
        for k in keys {
            let v = m.get_item(&k).unwrap_or_default();
            out.insert(k, v);
        }
    }
    out.insert(Value::from(key), value);
    Value::from(out)
}

/// Cuts the rendered text where the marked final message ends (transformers: at the tag, or
/// before the whitespace the template trimmed from it).
fn cut_at_mark(rendered: String, final_text: &str) -> Result<String, TokenizerError> {
    let tag = CONTINUE_TAG.trim_end();
    if !rendered.contains(py_strip(final_text)) || !rendered.contains(tag) {
        return Err(TokenizerError::Request(
            "continue_final_message: the final message does not appear in the rendered chat".into(),
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    let mut text = rendered;
    if text[at..].starts_with(CONTINUE_TAG) {
        text.truncate(at);
    } else {
        text.truncate(at);
        let kept = text.trim_end_matches(py_space).len();
        text.truncate(kept);
    }
    Ok(text)
}

/// Python's `str.isspace` (Rust's whitespace plus the four information separators).
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn py_strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

#[cfg(test)]
mod tests;
