//! Deterministic text and the simulator's documented tokenizer.
//!
//! **Tokenizer.** Text is cut into *pieces*: a run of whitespace followed by a run of
//! alphanumeric characters, or a run of whitespace followed by one other character. Each piece is
//! cut into chunks of at most 4 bytes (on character boundaries); every chunk is one token. A chunk
//! that is one of the generator's words (`" the"`, `" sky"`, …) has the id `1000 + index`; any
//! other chunk has the id `2000 + fnv1a(chunk) % 30000`. Roughly "1 token ≈ 4 characters".
//!
//! **Generator.** An answer is a sequence of words of 1–3 letters, each preceded by one space, so
//! each generated word is exactly one token and re-tokenizing an answer gives back its token count
//! (usage is always consistent with the text). The words and the natural answer length are drawn
//! from a SplitMix64 stream seeded by (seed, model, prompt): the same request with the same seed
//! gives the same text.
//!
//! **Chat template.** Messages are rendered as `<|role|>\ncontent\n` each, followed by
//! `<|assistant|>\n`, and the rendered text is tokenized; that is the prompt of chat requests
//! (usage.prompt_tokens, prefix caching and vLLM `/tokenize` with `messages` all agree).

/// The generator's vocabulary (each entry is one token when preceded by a space).
pub(crate) const WORDS: &[&str] = &[
    "the", "a", "of", "to", "and", "in", "is", "it", "you", "he", "was", "for", "on", "are", "as",
    "his", "at", "be", "one", "had", "by", "but", "not", "all", "we", "can", "an", "or", "sky",
    "sea", "sun", "red", "big", "new", "old", "way", "day", "man", "may", "now", "see", "two",
    "how", "our", "out", "use", "say", "she", "her", "him", "has", "its", "who", "did", "get",
    "let", "put", "run", "set", "try", "ask", "end", "own", "far", "few", "got", "low", "top",
    "war", "law", "art", "air", "oil", "age", "job", "key", "car", "map", "dog", "cat", "fox",
    "owl", "bee", "ant", "elk", "yak", "emu", "cow", "pig", "hen", "ram", "eel", "cod", "bay",
    "dew", "fog", "ice", "mud", "ash", "elm", "oak", "ivy", "fig", "pea", "yam", "tea", "pie",
    "jam", "egg", "ham", "nut", "gem", "ore", "tin", "ink", "pen", "cup", "pot", "pan", "box",
    "bag", "hat", "cap", "bed", "rug", "fan", "toy", "kit", "net", "web", "app", "bus", "van",
    "jet", "cab", "hub", "log", "row", "tab", "bit", "bug", "fix", "add", "mix", "zip", "tag",
    "sum", "max", "min", "odd", "raw", "dry", "wet", "hot", "icy", "shy", "sly", "fit", "fun",
    "wry", "apt", "yes", "no", "so", "up", "if", "go", "do", "me", "my", "us", "am", "hi", "ok",
    "oh", "ah", "ox", "ex", "yo",
];

/// FNV-1a, 64 bit.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64: a tiny deterministic generator.
#[derive(Clone)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

fn word_id(chunk: &str) -> Option<u32> {
    let w = chunk.strip_prefix(' ')?;
    WORDS.iter().position(|x| *x == w).map(|i| 1000 + i as u32)
}

fn push_chunks(piece: &str, out: &mut Vec<u32>) {
    let mut start = 0;
    while start < piece.len() {
        let mut end = (start + 4).min(piece.len());
        while end > start && !piece.is_char_boundary(end) {
            end -= 1;
        }
        if end == start {
            // a character wider than 4 bytes cannot happen in UTF-8, but never loop forever
            end = piece.len();
        }
        let chunk = &piece[start..end];
        let id = word_id(chunk).unwrap_or_else(|| 2000 + (fnv1a(chunk.as_bytes()) % 30_000) as u32);
        out.push(id);
        start = end;
    }
}

fn for_each_piece(text: &str, mut f: impl FnMut(&str)) {
    let bytes = text.as_bytes();
    let mut i = 0;
    let n = text.len();
    while i < n {
        let start = i;
        // leading whitespace
        while i < n && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= n {
            f(&text[start..n]);
            break;
        }
        let Some(c) = text[i..].chars().next() else {
            break;
        };
        if c.is_alphanumeric() {
            while i < n {
                match text[i..].chars().next() {
                    Some(c) if c.is_alphanumeric() => i += c.len_utf8(),
                    _ => break,
                }
            }
        } else {
            i += c.len_utf8();
        }
        f(&text[start..i]);
    }
}

/// Token ids of `text` (see the module doc).
pub(crate) fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 3 + 1);
    for_each_piece(text, |p| push_chunks(p, &mut out));
    out
}

/// Token count of `text`, without allocating the ids.
pub(crate) fn count_tokens(text: &str) -> usize {
    let mut n = 0;
    for_each_piece(text, |p| {
        let mut start = 0;
        while start < p.len() {
            let mut end = (start + 4).min(p.len());
            while end > start && !p.is_char_boundary(end) {
                end -= 1;
            }
            if end == start {
                end = p.len();
            }
            n += 1;
            start = end;
        }
    });
    n
}

/// The text pieces of `text`, one per token (what TGI's `/tokenize` and vLLM's `token_strs` show).
pub(crate) fn token_strs(text: &str) -> Vec<(u32, String, usize, usize)> {
    let mut out = Vec::new();
    let mut offset = 0usize;
    for_each_piece(text, |p| {
        let mut ids = Vec::new();
        push_chunks(p, &mut ids);
        let mut start = 0;
        for id in ids {
            let mut end = (start + 4).min(p.len());
            while end > start && !p.is_char_boundary(end) {
                end -= 1;
            }
            if end == start {
                end = p.len();
            }
            out.push((id, p[start..end].to_string(), offset + start, offset + end));
            start = end;
        }
        offset += p.len();
    });
    out
}

/// Text of token ids: generator words are restored, other ids render as U+FFFD.
pub(crate) fn detokenize(ids: &[i64]) -> String {
    let mut s = String::new();
    for id in ids {
        let idx = id - 1000;
        if (0..WORDS.len() as i64).contains(&idx) {
            s.push(' ');
            s.push_str(WORDS[idx as usize]);
        } else {
            s.push('\u{fffd}');
        }
    }
    s
}

/// The text of generated token `word` (an index into [`WORDS`]).
pub(crate) fn word_text(word: u16) -> &'static str {
    // " " + word: stored without the space; callers add it.
    WORDS[(word as usize) % WORDS.len()]
}

/// Render chat messages with the simulator's template (see the module doc).
pub(crate) fn render_chat<'a>(messages: impl Iterator<Item = (&'a str, String)>) -> String {
    render_chat_with(messages, Render::Answer)
}

/// How a conversation is rendered for the model: the three forms of a chat template that
/// vLLM's `add_generation_prompt` / `continue_final_message` select.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Render {
    /// The messages, then the assistant header: the model answers with a new turn (the
    /// default, `add_generation_prompt: true`).
    Answer,
    /// The messages only (`add_generation_prompt: false`).
    Plain,
    /// The last message left open, without its line end and without a new header, so the
    /// model continues it (`continue_final_message: true`): an assistant "prefill".
    ContinueLast,
}

/// Render chat messages in one of the template's forms.
pub(crate) fn render_chat_with<'a>(
    messages: impl Iterator<Item = (&'a str, String)>,
    form: Render,
) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|>\n");
        s.push_str(&content);
        s.push('\n');
    }
    match form {
        Render::Answer => s.push_str("<|assistant|>\n"),
        Render::Plain => {}
        Render::ContinueLast => {
            s.pop();
        }
    }
    s
}

/// Most trailing words of a prompt checked for being the start of its own answer.
const MAX_CONTINUED_WORDS: usize = 16_384;

/// The generator words (" w", one token each) `text` ends with, as (byte offset, word index),
/// first word first; at most [`MAX_CONTINUED_WORDS`].
fn trailing_words(text: &str) -> Vec<(usize, u16)> {
    let mut out = Vec::new();
    let mut end = text.len();
    while out.len() < MAX_CONTINUED_WORDS {
        let Some(space) = text[..end].rfind(' ') else {
            break;
        };
        let Some(i) = WORDS.iter().position(|w| *w == &text[space + 1..end]) else {
            break;
        };
        out.push((space, i as u16));
        end = space;
    }
    out.reverse();
    out
}

/// Why an answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// The model stopped by itself.
    Stop,
    /// `max_tokens` was reached.
    Length,
}

impl Finish {
    pub(crate) fn as_openai(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// The generator of the answer to a prompt whose hash is `prompt_hash`.
fn answer_rng(seed: u64, model: &str, prompt_hash: u64) -> SplitMix {
    SplitMix::new(
        seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ fnv1a(model.as_bytes()).rotate_left(17)
            ^ prompt_hash,
    )
}

/// The length an answer has when nothing stops it earlier (its first draw).
fn natural_len(rng: &mut SplitMix, min_len: u32, max_len: u32) -> u32 {
    let span = u64::from(max_len.saturating_sub(min_len)) + 1;
    min_len + rng.below(span) as u32
}

/// A prompt's tokens as the engine counts them: the ids (empty when nobody needs them:
/// speed 0 without a scheduler, and no real tokenizer) and their number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PromptTokens {
    pub ids: Vec<u32>,
    pub len: u32,
}

impl PromptTokens {
    /// `text` by the simulator's own tokenizer: its ids when `need_ids`, else only their count.
    pub(crate) fn of_text(text: &str, need_ids: bool) -> PromptTokens {
        if need_ids {
            PromptTokens::from_ids(tokenize(text))
        } else {
            PromptTokens {
                ids: Vec::new(),
                len: count_tokens(text) as u32,
            }
        }
    }

    /// Ids computed elsewhere (a real tokenizer, or given by the request).
    pub(crate) fn from_ids(ids: Vec<u32>) -> PromptTokens {
        let len = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        PromptTokens { ids, len }
    }
}

/// A planned answer: the words, why it ends, and the prompt it answers.
pub(crate) struct Plan {
    pub words: Vec<u16>,
    pub finish: Finish,
    /// Prompt token ids (empty when the caller did not need them: speed 0, no scheduler).
    pub prompt_ids: Vec<u32>,
    pub prompt_len: u32,
    /// The `max_tokens` the answer was planned under (`None`: no cap was given).
    pub max_tokens: Option<u32>,
    /// The LoRA adapter the engine runs it under (none: the base model).
    pub adapter: Option<std::sync::Arc<super::lora::Adapter>>,
}

impl Plan {
    /// Deterministic answer to `prompt` (the simulator's rendering, which seeds the words) for
    /// `model`, whose tokens the engine counts as `tokens`; `max_tokens` caps the natural
    /// length.
    pub(crate) fn new(
        seed: u64,
        model: &str,
        prompt: &str,
        tokens: PromptTokens,
        max_tokens: Option<u32>,
        min_len: u32,
        max_len: u32,
    ) -> Plan {
        match Plan::continuing(seed, model, prompt, max_tokens, min_len, max_len) {
            Some((words, finish)) => Plan {
                words,
                finish,
                prompt_ids: tokens.ids,
                prompt_len: tokens.len,
                max_tokens,
                adapter: None,
            },
            None => Plan::fresh(seed, model, prompt, tokens, max_tokens, min_len, max_len),
        }
    }

    /// A prompt that ends with the beginning of its own answer (an open assistant message, or
    /// a completions prompt with the text so far appended) is continued where that answer
    /// stands, as a model decoding deterministically continues its own output: the words
    /// after the ones already there, `max_tokens` counting only the new ones. The answer is
    /// the one planned for the prompt without those words; the longest such beginning wins.
    fn continuing(
        seed: u64,
        model: &str,
        prompt: &str,
        max_tokens: Option<u32>,
        min_len: u32,
        max_len: u32,
    ) -> Option<(Vec<u16>, Finish)> {
        let tail = trailing_words(prompt);
        if tail.is_empty() {
            return None;
        }
        // The prompt's hash at each place the answer could begin, in one pass.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut at = 0;
        let mut hashes = Vec::with_capacity(tail.len());
        for (cut, _) in &tail {
            for b in &prompt.as_bytes()[at..*cut] {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            at = *cut;
            hashes.push(h);
        }
        for (start, hash) in hashes.into_iter().enumerate() {
            let given = &tail[start..];
            let mut rng = answer_rng(seed, model, hash);
            let natural = natural_len(&mut rng, min_len, max_len) as usize;
            if natural < given.len() {
                continue;
            }
            let mut next = || rng.below(WORDS.len() as u64) as u16;
            if !given.iter().all(|(_, w)| next() == *w) {
                continue;
            }
            let rest = natural - given.len();
            let (len, finish) = match max_tokens {
                Some(m) if (m as usize) < rest => (m as usize, Finish::Length),
                _ => (rest, Finish::Stop),
            };
            return Some(((0..len).map(|_| next()).collect(), finish));
        }
        None
    }

    /// The answer to `prompt` as a new answer.
    fn fresh(
        seed: u64,
        model: &str,
        prompt: &str,
        tokens: PromptTokens,
        max_tokens: Option<u32>,
        min_len: u32,
        max_len: u32,
    ) -> Plan {
        let mut rng = answer_rng(seed, model, fnv1a(prompt.as_bytes()));
        let natural = natural_len(&mut rng, min_len, max_len);
        let (len, finish) = match max_tokens {
            Some(m) if m < natural => (m, Finish::Length),
            _ => (natural, Finish::Stop),
        };
        let words = (0..len)
            .map(|_| rng.below(WORDS.len() as u64) as u16)
            .collect();
        Plan {
            words,
            finish,
            prompt_ids: tokens.ids,
            prompt_len: tokens.len,
            max_tokens,
            adapter: None,
        }
    }

    /// The same plan, run by the engine under `adapter` (the caller seeds the words with the
    /// adapter's name, so its answers differ from the base model's).
    pub(crate) fn under(mut self, adapter: Option<std::sync::Arc<super::lora::Adapter>>) -> Plan {
        self.adapter = adapter;
        self
    }

    /// Fit the prompt into a context window of `num_ctx` the way Ollama does (context shift on,
    /// its default): a prompt of `num_ctx` tokens or more keeps its first `num_keep` tokens and
    /// its end, dropping about half of the rest of the window, so the model reads — and
    /// spends prefill time on — only what fits.
    pub(crate) fn fit_context(&mut self, num_ctx: u32, num_keep: u32) {
        if num_ctx <= 1 || self.prompt_len < num_ctx {
            return;
        }
        let keep = num_keep.min(num_ctx - 1);
        let limit = num_ctx - ((num_ctx - keep) / 2).max(1);
        let dropped = self.prompt_len - limit;
        if self.prompt_ids.len() == self.prompt_len as usize {
            let (keep, dropped) = (keep as usize, dropped as usize);
            self.prompt_ids.drain(keep..keep + dropped);
        }
        self.prompt_len = limit;
    }

    pub(crate) fn prompt_tokens(&self) -> u32 {
        self.prompt_len
    }
    pub(crate) fn completion_tokens(&self) -> u32 {
        self.words.len() as u32
    }
    /// Text of words `from..to`.
    pub(crate) fn text(&self, from: usize, to: usize) -> String {
        let to = to.min(self.words.len());
        let mut s = String::with_capacity((to.saturating_sub(from)) * 4);
        for w in self.words.iter().take(to).skip(from) {
            s.push(' ');
            s.push_str(word_text(*w));
        }
        s
    }
    /// Token id of word `i`.
    pub(crate) fn token_id(&self, i: usize) -> u32 {
        self.words
            .get(i)
            .map(|w| 1000 + (*w as u32 % WORDS.len() as u32))
            .unwrap_or(0)
    }
}

/// Deterministic unit-length embedding of `text`.
pub(crate) fn embedding(seed: u64, text: &str, dim: usize) -> Vec<f32> {
    let mut rng = SplitMix::new(seed ^ fnv1a(text.as_bytes()));
    let mut v: Vec<f32> = (0..dim)
        .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in &mut v {
            *x /= norm;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(seed: u64, prompt: &str, max: Option<u32>, min: u32, most: u32, ids: bool) -> Plan {
        let tokens = PromptTokens::of_text(prompt, ids);
        Plan::new(seed, "m", prompt, tokens, max, min, most)
    }

    #[test]
    fn generated_text_round_trips_through_the_tokenizer() {
        let p = plan(7, "hello there", Some(50), 16, 128, true);
        let text = p.text(0, p.words.len());
        assert_eq!(count_tokens(&text), p.words.len());
        assert_eq!(tokenize(&text).len(), p.words.len());
    }

    #[test]
    fn same_seed_same_text() {
        let a = plan(1, "x", None, 4, 40, false);
        let b = plan(1, "x", None, 4, 40, false);
        let c = plan(2, "x", None, 4, 40, false);
        assert_eq!(a.words, b.words);
        assert_ne!(a.words, c.words);
    }

    #[test]
    fn a_prompt_ending_in_its_own_answer_continues_it() {
        let prompt = render_chat([("user", "tell me".to_string())].into_iter());
        let whole = plan(3, &prompt, None, 20, 40, false);
        let text = whole.text(0, whole.words.len());
        for k in [1, 5, whole.words.len() - 1, whole.words.len()] {
            let partial = whole.text(0, k);
            let open = render_chat_with(
                [
                    ("user", "tell me".to_string()),
                    ("assistant", partial.clone()),
                ]
                .into_iter(),
                Render::ContinueLast,
            );
            assert_eq!(open, format!("{prompt}{partial}"));
            let rest = plan(3, &open, None, 20, 40, true);
            assert_eq!(format!("{partial}{}", rest.text(0, 99)), text, "after {k}");
            assert_eq!(rest.finish, Finish::Stop);
            assert_eq!(rest.prompt_len as usize, count_tokens(&open));
            // max_tokens counts only the new words
            let capped = plan(3, &open, Some(2), 20, 40, false);
            let expect = (whole.words.len() - k).min(2);
            assert_eq!(capped.words[..], whole.words[k..k + expect]);
        }
        let plain = render_chat_with([("user", "x".to_string())].into_iter(), Render::Plain);
        assert_eq!(plain, "<|user|>\nx\n");
    }

    #[test]
    fn tokenizer_counts_chunks() {
        assert_eq!(count_tokens("Hello world"), 4); // "Hell" "o" " wor" "ld"
        assert_eq!(tokenize("Hello world").len(), 4);
        assert_eq!(count_tokens(""), 0);
        assert_eq!(count_tokens(" the sky"), 2);
        assert_eq!(count_tokens("héllo, wörld!"), count_tokens("héllo, wörld!"));
    }
}
