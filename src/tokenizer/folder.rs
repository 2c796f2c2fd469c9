//! A model's tokenizer folder read from disk as transformers 5 reads it for vLLM: nothing is
//! ever downloaded.
//!
//! - `tokenizer.json` (required): the Hugging Face tokenizer as it is, its post-processor
//!   deciding which special tokens an encode "with special tokens" adds (transformers 5 ignores
//!   the config's `add_bos_token` / `add_eos_token` when there is a `tokenizer.json`). The
//!   special tokens named in `tokenizer_config.json` that the vocabulary lacks are added, as
//!   transformers adds them; the stored truncation and padding are dropped (vLLM sets its own
//!   per call).
//! - `tokenizer_config.json` (optional): `bos_token`, `eos_token`, `unk_token`, `pad_token`
//!   (a string or `{"content": …}`) and `chat_template` (a string, or a list of
//!   `{"name", "template"}`).
//! - `chat_template.jinja` and `additional_chat_templates/<name>.jinja` (optional): when
//!   present they are the templates (the first one named `default`), and the config's
//!   `chat_template` is not read.
//!
//! Invariant: every error names the file and what is wrong with it.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tokenizers::AddedToken;

use super::encode::Encoder;
use super::TokenizerError;

/// The special tokens a template is given, from `tokenizer_config.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Specials {
    pub(crate) bos: Option<String>,
    pub(crate) eos: Option<String>,
    pub(crate) unk: Option<String>,
    pub(crate) pad: Option<String>,
}

impl Specials {
    /// `(name, token)` for each token that is set, in transformers' order.
    pub(crate) fn named(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("unk_token", &self.unk),
            ("pad_token", &self.pad),
        ]
        .into_iter()
        .filter_map(|(name, t)| t.as_deref().map(|t| (name, t)))
    }
}

/// What a folder holds.
pub(crate) struct Folder {
    pub(crate) encoder: Encoder,
    /// `(name, source, the file it comes from)`, `default` first.
    pub(crate) templates: Vec<(String, String, PathBuf)>,
    pub(crate) specials: Specials,
}

fn invalid(path: &Path, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Read {
        path: path.to_path_buf(),
        source,
    })
}

impl Folder {
    pub(crate) fn read(dir: &Path) -> Result<Folder, TokenizerError> {
        if !dir.is_dir() {
            return Err(invalid(dir, "not a folder"));
        }
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            let text = read(&config_path)?;
            serde_json::from_str::<Json>(&text)
                .map_err(|e| invalid(&config_path, format!("not JSON: {e}")))?
        } else {
            Json::Null
        };
        if !config.is_object() && !config.is_null() {
            return Err(invalid(&config_path, "not a JSON object"));
        }
        let specials = specials(&config);
        let encoder = encoder(&dir.join("tokenizer.json"), &config, &specials)?;
        let templates = templates(dir, &config, &config_path)?;
        Ok(Folder {
            encoder,
            templates,
            specials,
        })
    }
}

/// A special token's text: a string, or an added-token object's `content`.
fn token_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn specials(config: &Json) -> Specials {
    Specials {
        bos: token_text(config.get("bos_token")),
        eos: token_text(config.get("eos_token")),
        unk: token_text(config.get("unk_token")),
        pad: token_text(config.get("pad_token")),
    }
}

fn encoder(path: &Path, config: &Json, specials: &Specials) -> Result<Encoder, TokenizerError> {
    let bytes = std::fs::read(path).map_err(|source| TokenizerError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let json: Json =
        serde_json::from_slice(&bytes).map_err(|e| invalid(path, format!("not JSON: {e}")))?;
    let mut t = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| invalid(path, format!("not a tokenizer: {e}")))?;
    t.with_truncation(None)
        .map_err(|e| invalid(path, e.to_string()))?;
    t.with_padding(None);
    let mut extra: Vec<String> = specials.named().map(|(_, s)| s.to_owned()).collect();
    for key in ["additional_special_tokens", "extra_special_tokens"] {
        if let Some(list) = config.get(key).and_then(Json::as_array) {
            extra.extend(list.iter().filter_map(|v| token_text(Some(v))));
        }
    }
    let missing: Vec<AddedToken> = extra
        .iter()
        .filter(|s| t.token_to_id(s).is_none())
        .map(|s| AddedToken::from(s.clone(), true))
        .collect();
    if !missing.is_empty() {
        t.add_special_tokens(missing)
            .map_err(|e| invalid(path, format!("adding special tokens: {e}")))?;
    }
    Ok(Encoder::new(t, &json))
}

type Named = Vec<(String, String, PathBuf)>;

/// The templates, each with the file it comes from (see the module doc).
fn templates(dir: &Path, config: &Json, config_path: &Path) -> Result<Named, TokenizerError> {
    let jinja = dir.join("chat_template.jinja");
    let mut named = Vec::new();
    if jinja.exists() {
        named.push(("default".to_string(), read(&jinja)?, jinja));
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let entries = std::fs::read_dir(&extra).map_err(|source| TokenizerError::Read {
            path: extra.clone(),
            source,
        })?;
        let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        for f in files
            .iter()
            .filter(|f| f.extension().is_some_and(|x| x == "jinja"))
        {
            let name = f.file_stem().map(|s| s.to_string_lossy().into_owned());
            named.push((name.unwrap_or_default(), read(f)?, f.clone()));
        }
    }
    if !named.is_empty() {
        return Ok(named);
    }
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::String(s)) => Ok(vec![(
            "default".to_string(),
            s.clone(),
            config_path.to_path_buf(),
        )]),
        Some(Json::Array(items)) => config_templates(items, config_path),
        Some(_) => Err(invalid(
            config_path,
            "chat_template is neither a string nor a list of {name, template}",
        )),
    }
}

fn config_templates(items: &[Json], path: &Path) -> Result<Named, TokenizerError> {
    let mut out = Vec::new();
    for item in items {
        let name = item.get("name").and_then(Json::as_str);
        let template = item.get("template").and_then(Json::as_str);
        match (name, template) {
            (Some(n), Some(t)) => out.push((n.to_owned(), t.to_owned(), path.to_path_buf())),
            _ => {
                return Err(invalid(
                    path,
                    "a chat_template entry lacks a string `name` or `template`",
                ))
            }
        }
    }
    Ok(out)
}
