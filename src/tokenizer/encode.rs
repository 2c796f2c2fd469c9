//! Text to token ids: the Hugging Face tokenizer's own pipeline, and a direct path for the
//! byte-level BPE tokenizers most chat models use, which gives the same ids several times
//! faster.
//!
//! The pipeline of the `tokenizers` crate keeps, for every piece of text, a map of each byte
//! back to the original text (for offsets), and builds a string for every token; on a long
//! prompt that bookkeeping, not the BPE itself, is most of the time. The direct path does only
//! what decides the ids, in the same order and with the same parts:
//! 1. the added tokens (special or not) are found first, as the pipeline finds them: those
//!    not normalized over the whole text, then those normalized over what is left, each set
//!    leftmost-longest (the same automaton crate the pipeline uses);
//! 2. every other stretch is cut by the pre-tokenizer's regular expression (matched as the
//!    pipeline matches it, see [`super::split`]): each match and each gap between matches is a
//!    word;
//! 3. each word's bytes are mapped to the byte-level alphabet and given to the tokenizer's own
//!    BPE model; its ids are remembered per word (bounded), since prompts repeat words;
//! 4. the post-processor's special tokens go before and after.
//!
//! Invariant: the direct path is used only for a tokenizer whose `tokenizer.json` is of a shape
//! it reproduces exactly (no normalizer; a byte-level pre-tokenizer, alone or after one
//! isolating regex split; a BPE model without dropout; added tokens without strip or
//! single-word rules; a post-processor that only adds tokens around the text), and only after
//! it gave the pipeline's ids on a set of probe texts at load. Anything else uses the pipeline.

use std::sync::RwLock;

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use hashbrown::HashMap;
use serde_json::Value as Json;
use tokenizers::Model;

use super::split::Splitter;

/// GPT-2's pre-tokenizer expression, which a byte-level pre-tokenizer with `use_regex` splits
/// by.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Words remembered with their ids, at most (about 10 MB with typical words).
const MAX_CACHED_WORDS: usize = 100_000;

/// Longest word remembered (longer ones are rare and would bloat the cache).
const MAX_CACHED_WORD_BYTES: usize = 64;

/// Texts the direct path must encode exactly as the pipeline does before it is used.
const PROBES: &[&str] = &[
    "Hello, world! It's 2024-07-26; we'll see   you\tthere.\n\n  Next   line  ",
    "naïve café — über 日本語 🚀 ’quotes’ \"double\" \\back\\ <tag>x</tag>",
    "  leading and trailing spaces   ",
    "\n\n\r\n\t \u{a0}\u{3000}x",
    "123456789 3.14159 1e10 0x1F ÀÉÎÕÜ ÿ",
];

/// Encodes text as the tokenizer does (see the module doc).
pub(crate) struct Encoder {
    pipeline: tokenizers::Tokenizer,
    direct: Option<Direct>,
}

/// What the direct path needs, read from `tokenizer.json`.
struct Direct {
    /// Added tokens matched on the raw text, then on what is left.
    raw_tokens: Option<DoubleArrayAhoCorasick<u32>>,
    normalized_tokens: Option<DoubleArrayAhoCorasick<u32>>,
    split: Splitter,
    /// The byte-level alphabet: the character each byte is written as.
    alphabet: [char; 256],
    /// Ids the post-processor puts before and after the text.
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    words: RwLock<HashMap<Box<str>, Box<[u32]>>>,
}

impl Encoder {
    /// The encoder of `pipeline`, whose `tokenizer.json` text is `json`.
    pub(crate) fn new(pipeline: tokenizers::Tokenizer, json: &Json) -> Encoder {
        let direct = Direct::new(&pipeline, json);
        let mut encoder = Encoder { pipeline, direct };
        if !encoder.direct_agrees() {
            encoder.direct = None;
        }
        encoder
    }

    /// Whether the direct path is in use.
    #[cfg(test)]
    pub(crate) fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    pub(crate) fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        match &self.direct {
            Some(d) => d.encode(&self.pipeline, text, add_special),
            None => self.slow(text, add_special),
        }
    }

    /// The tokenizer's own pipeline.
    pub(crate) fn slow(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        self.pipeline
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    pub(crate) fn id_to_token(&self, id: u32) -> Option<String> {
        self.pipeline.id_to_token(id)
    }

    fn direct_agrees(&self) -> bool {
        let Some(d) = &self.direct else { return false };
        let mut probes: Vec<String> = PROBES.iter().map(|p| p.to_string()).collect();
        let added = self.pipeline.get_added_tokens_decoder();
        let mut contents: Vec<&str> = added.values().map(|t| t.content.as_str()).collect();
        contents.sort();
        for chunk in contents.chunks(8).take(16) {
            probes.push(format!("a{} b {}c", chunk.join(" x"), chunk.join("")));
        }
        let agree = probes.iter().all(|p| {
            [false, true].iter().all(|special| {
                let fast = d.encode(&self.pipeline, p, *special);
                fast.is_ok() && fast == self.slow(p, *special)
            })
        });
        if let Ok(mut words) = d.words.write() {
            words.clear();
        }
        agree
    }
}

impl Direct {
    fn new(pipeline: &tokenizers::Tokenizer, json: &Json) -> Option<Direct> {
        if !json.get("normalizer").is_none_or(Json::is_null) {
            return None;
        }
        let model = json.get("model")?;
        if model.get("type")?.as_str()? != "BPE" || !model.get("dropout").is_none_or(Json::is_null)
        {
            return None;
        }
        let split = Splitter::new(&split_pattern(json.get("pre_tokenizer")?)?)?;
        let (prefix, suffix) = around(json.get("post_processor").unwrap_or(&Json::Null))?;
        let (raw_tokens, normalized_tokens) = added_tokens(pipeline)?;
        Some(Direct {
            raw_tokens,
            normalized_tokens,
            split,
            alphabet: byte_alphabet(),
            prefix,
            suffix,
            words: RwLock::new(HashMap::new()),
        })
    }

    fn encode(
        &self,
        pipeline: &tokenizers::Tokenizer,
        text: &str,
        add_special: bool,
    ) -> Result<Vec<u32>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 8);
        if add_special {
            ids.extend_from_slice(&self.prefix);
        }
        let mut result = Ok(());
        for_each_piece(self.raw_tokens.as_ref(), text, &mut |piece| match piece {
            Piece::Added(id) => ids.push(id),
            Piece::Text(raw_gap) => for_each_piece(
                self.normalized_tokens.as_ref(),
                raw_gap,
                &mut |piece| match piece {
                    Piece::Added(id) => ids.push(id),
                    Piece::Text(gap) => {
                        if let Err(e) = self.words(pipeline, gap, &mut ids) {
                            result = Err(e);
                        }
                    }
                },
            ),
        });
        result?;
        if add_special {
            ids.extend_from_slice(&self.suffix);
        }
        Ok(ids)
    }

    /// The ids of a stretch without added tokens: each match of the split expression and
    /// each gap between matches is one word.
    fn words(
        &self,
        pipeline: &tokenizers::Tokenizer,
        text: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), String> {
        let mut at = 0;
        let mut result = Ok(());
        self.split.for_each_match(text, |start, end| {
            if result.is_err() {
                return;
            }
            if at < start {
                result = self.word(pipeline, &text[at..start], ids);
            }
            if start < end && result.is_ok() {
                result = self.word(pipeline, &text[start..end], ids);
            }
            at = end;
        });
        result?;
        if at < text.len() {
            self.word(pipeline, &text[at..], ids)?;
        }
        Ok(())
    }

    fn word(
        &self,
        pipeline: &tokenizers::Tokenizer,
        word: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), String> {
        if let Ok(words) = self.words.read() {
            if let Some(known) = words.get(word) {
                ids.extend_from_slice(known);
                return Ok(());
            }
        }
        let mapped: String = word.bytes().map(|b| self.alphabet[b as usize]).collect();
        let tokens = pipeline
            .get_model()
            .tokenize(&mapped)
            .map_err(|e| e.to_string())?;
        let start = ids.len();
        ids.extend(tokens.iter().map(|t| t.id));
        if word.len() <= MAX_CACHED_WORD_BYTES {
            if let Ok(mut words) = self.words.write() {
                if words.len() < MAX_CACHED_WORDS {
                    words.insert(word.into(), ids[start..].into());
                }
            }
        }
        Ok(())
    }
}

enum Piece<'a> {
    Added(u32),
    Text(&'a str),
}

/// The added-token matches of `text` and the stretches between them, in order.
fn for_each_piece<'a>(
    tokens: Option<&DoubleArrayAhoCorasick<u32>>,
    text: &'a str,
    f: &mut dyn FnMut(Piece<'a>),
) {
    let Some(tokens) = tokens else {
        if !text.is_empty() {
            f(Piece::Text(text));
        }
        return;
    };
    let mut at = 0;
    for m in tokens.leftmost_find_iter(text) {
        if at < m.start() {
            f(Piece::Text(&text[at..m.start()]));
        }
        f(Piece::Added(m.value()));
        at = m.end();
    }
    if at < text.len() {
        f(Piece::Text(&text[at..]));
    }
}

/// The split expression of a pre-tokenizer the direct path reproduces: byte-level with its
/// own regex, or one isolating regex split followed by byte-level without regex.
fn split_pattern(pre: &Json) -> Option<String> {
    let kind = pre.get("type")?.as_str()?;
    let plain_byte_level = |p: &Json, regex: bool| {
        p.get("type").and_then(Json::as_str) == Some("ByteLevel")
            && p.get("add_prefix_space").and_then(Json::as_bool) == Some(false)
            && p.get("use_regex").and_then(Json::as_bool).unwrap_or(true) == regex
    };
    match kind {
        "ByteLevel" if plain_byte_level(pre, true) => Some(GPT2_SPLIT.to_string()),
        "Sequence" => match pre.get("pretokenizers")?.as_array()?.as_slice() {
            [split, byte_level] if plain_byte_level(byte_level, false) => {
                let isolated = split.get("type")?.as_str()? == "Split"
                    && split.get("behavior")?.as_str()? == "Isolated"
                    && !split.get("invert")?.as_bool()?;
                isolated.then_some(())?;
                Some(split.get("pattern")?.get("Regex")?.as_str()?.to_string())
            }
            [byte_level] if plain_byte_level(byte_level, true) => Some(GPT2_SPLIT.to_string()),
            _ => None,
        },
        _ => None,
    }
}

/// The ids a post-processor puts before and after one text: none, byte-level (offsets only),
/// a template of special tokens around `$A`, or a sequence of those.
fn around(post: &Json) -> Option<(Vec<u32>, Vec<u32>)> {
    if post.is_null() {
        return Some((Vec::new(), Vec::new()));
    }
    match post.get("type")?.as_str()? {
        "ByteLevel" => Some((Vec::new(), Vec::new())),
        "TemplateProcessing" => template_around(post),
        "Sequence" => {
            let mut prefix = Vec::new();
            let mut suffix = Vec::new();
            for p in post.get("processors")?.as_array()? {
                let (before, after) = around(p)?;
                prefix.splice(0..0, before);
                suffix.extend(after);
            }
            Some((prefix, suffix))
        }
        _ => None,
    }
}

fn template_around(post: &Json) -> Option<(Vec<u32>, Vec<u32>)> {
    let specials = post.get("special_tokens")?;
    let mut prefix = Vec::new();
    let mut suffix = Vec::new();
    let mut seen_text = false;
    for piece in post.get("single")?.as_array()? {
        if piece.get("Sequence").is_some() {
            if seen_text {
                return None;
            }
            seen_text = true;
            continue;
        }
        let name = piece.get("SpecialToken")?.get("id")?.as_str()?;
        let ids = specials.get(name)?.get("ids")?.as_array()?;
        let ids: Option<Vec<u32>> = ids
            .iter()
            .map(|i| i.as_u64().and_then(|i| u32::try_from(i).ok()))
            .collect();
        if seen_text { &mut suffix } else { &mut prefix }.extend(ids?);
    }
    seen_text.then_some((prefix, suffix))
}

type Tries = (
    Option<DoubleArrayAhoCorasick<u32>>,
    Option<DoubleArrayAhoCorasick<u32>>,
);

/// The added tokens' automata (raw, normalized); `None` if some token strips spaces or must
/// be a single word (rules the direct path does not reproduce).
fn added_tokens(pipeline: &tokenizers::Tokenizer) -> Option<Tries> {
    let mut raw = Vec::new();
    let mut normalized = Vec::new();
    for (id, t) in pipeline.get_added_tokens_decoder() {
        if t.lstrip || t.rstrip || t.single_word || t.content.is_empty() {
            return None;
        }
        if t.normalized {
            &mut normalized
        } else {
            &mut raw
        }
        .push((t.content, id));
    }
    let build = |pairs: Vec<(String, u32)>| -> Option<Option<DoubleArrayAhoCorasick<u32>>> {
        if pairs.is_empty() {
            return Some(None);
        }
        DoubleArrayAhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build_with_values(pairs)
            .ok()
            .map(Some)
    };
    Some((build(raw)?, build(normalized)?))
}

/// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others
/// (controls, space, a few more) are written as the characters from U+0100 on, in byte order.
fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{fffd}');
            next += 1;
            c
        };
    }
    table
}

#[cfg(test)]
mod tests;
