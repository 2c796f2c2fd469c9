//! A pre-tokenizer's regular expression, matched as the tokenizer matches it but faster.
//!
//! The expressions of byte-level tokenizers (GPT-2's, Llama 3's, Qwen's, …) end with
//! `|\s+(?!\S)|\s+`: a run of whitespace is one word, except that before a non-space it leaves
//! its last character to the next word (so `"  hi"` is `" "`, `" hi"`). The look-ahead makes
//! the whole expression a backtracking one (`fancy-regex`), which is most of the time of an
//! encode. Without it the rest is an ordinary expression that the `regex` crate matches with
//! the same leftmost-first rule and the same Unicode classes, so such an expression is matched
//! as `<rest>|\s+` and the look-ahead applied by hand: a match made of whitespace only that
//! `<rest>` does not match at its start came from `\s+`, and when a non-space follows it and it
//! is longer than one character, its last character is given back. Since the next match
//! usually starts where the last one ended, it is first looked for there (an anchored search,
//! one forward scan), and only then further on.
//!
//! Invariant: any other expression is matched by the tokenizer's own regex type, unchanged.

use regex_automata::meta::Regex;
use regex_automata::{Anchored, Input};
use tokenizers::utils::SysRegex;

/// The alternatives the look-ahead rule is recognised by.
const WHITESPACE_TAIL: &str = r"|\s+(?!\S)|\s+";

/// Finds the words of a text.
pub(crate) enum Splitter {
    /// `<rest>|\s+` (all matches) and `<rest>` (does it match where a whitespace run starts).
    Fast { all: Regex, rest: Regex },
    /// The tokenizer's own expression.
    Backtracking(SysRegex),
}

impl Splitter {
    pub(crate) fn new(pattern: &str) -> Option<Splitter> {
        if let Some(rest) = pattern.strip_suffix(WHITESPACE_TAIL) {
            let all = Regex::new(&format!(r"{rest}|\s+"));
            if let (Ok(all), Ok(rest)) = (all, Regex::new(rest)) {
                return Some(Splitter::Fast { all, rest });
            }
        }
        SysRegex::new(pattern).ok().map(Splitter::Backtracking)
    }

    /// Calls `f` with the byte range of every match in `text`, in order.
    pub(crate) fn for_each_match(&self, text: &str, mut f: impl FnMut(usize, usize)) {
        match self {
            Splitter::Backtracking(re) => re.find_iter(text).for_each(|(s, e)| f(s, e)),
            Splitter::Fast { all, rest } => {
                let mut at = 0;
                while at <= text.len() {
                    let here = Input::new(text).range(at..).anchored(Anchored::Yes);
                    let found = all
                        .search(&here)
                        .or_else(|| all.search(&here.anchored(Anchored::No)));
                    let Some(m) = found else { break };
                    let (start, mut end) = (m.start(), m.end());
                    if end < text.len()
                        && text[start..end].chars().all(char::is_whitespace)
                        && !rest.is_match(Input::new(text).range(start..).anchored(Anchored::Yes))
                    {
                        // the run is followed by a non-space: `\s+(?!\S)` keeps all but its
                        // last character, unless that leaves nothing (then `\s+` takes it all)
                        let last = text[start..end]
                            .chars()
                            .next_back()
                            .map_or(0, char::len_utf8);
                        if end - last > start {
                            end -= last;
                        }
                    }
                    f(start, end);
                    at = if end > start {
                        end
                    } else {
                        end + text[end..].chars().next().map_or(1, char::len_utf8)
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPT2: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    fn matches(s: &Splitter, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        s.for_each_match(text, |a, b| out.push((a, b)));
        out
    }

    /// SplitMix64 for the random texts.
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    #[test]
    fn the_fast_split_is_the_backtracking_split() {
        const PIECES: &[&str] = &[
            "a", "Hello", "É", "日本", "x1", "7", "1234567", "'s", "'S", "'ll", "'", " ", "  ",
            "   ", "\t", "\n", "\r", "\r\n", "\n\n", " \n", "\u{a0}", "\u{3000}", "\u{2028}",
            "\u{85}", ",", "!?", "—", "🚀", "\u{200b}", "\u{1}", "_", "-", "$",
        ];
        for pattern in [GPT2, LLAMA3, QWEN2] {
            let fast = Splitter::new(pattern);
            assert!(matches!(fast, Some(Splitter::Fast { .. })), "{pattern}");
            let slow = SysRegex::new(pattern).map(Splitter::Backtracking).ok();
            let (Some(fast), Some(slow)) = (fast, slow) else {
                panic!("{pattern} does not compile");
            };
            let mut state = 5;
            for _ in 0..20_000 {
                let n = 1 + next(&mut state) % 12;
                let text: String = (0..n)
                    .map(|_| PIECES[(next(&mut state) % PIECES.len() as u64) as usize])
                    .collect();
                assert_eq!(
                    matches(&fast, &text),
                    matches(&slow, &text),
                    "{text:?} by {pattern}"
                );
            }
        }
    }

    #[test]
    fn other_expressions_backtrack() {
        assert!(matches!(
            Splitter::new(r"\s+(?=x)|\w+"),
            Some(Splitter::Backtracking(_))
        ));
        assert!(Splitter::new(r"(unclosed").is_none());
    }
}
