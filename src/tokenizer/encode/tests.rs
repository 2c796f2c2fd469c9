use std::path::Path;

use super::*;

/// Llama 3's pre-tokenizer expression (a regex split before a byte-level step without regex).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn fixture_json() -> Json {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/tiny-tools/tokenizer.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"))
}

fn encoder(json: &Json) -> Encoder {
    let text = json.to_string();
    let mut t =
        tokenizers::Tokenizer::from_bytes(text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    // tokens the tokenizer lacks, added as tokenizer_config.json's specials are
    let extra = [
        AddedTokenSpec("<|eot|>", true, false),
        AddedTokenSpec("[tool]", false, true),
    ];
    let added: Vec<tokenizers::AddedToken> = extra
        .iter()
        .map(|s| tokenizers::AddedToken::from(s.0, s.1).normalized(s.2))
        .collect();
    t.add_tokens(added).unwrap_or_else(|e| panic!("{e}"));
    Encoder::new(t, json)
}

struct AddedTokenSpec(&'static str, bool, bool);

/// SplitMix64 for the random texts.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A random text of the pieces pre-tokenizers treat differently: letters (ASCII, accented,
/// CJK), digits, punctuation, contractions, every kind of space and line end, emoji, and the
/// added tokens' texts.
fn random_text(rng: &mut Rng) -> String {
    const PIECES: &[&str] = &[
        "a",
        "Hello",
        "world",
        "é",
        "Ünïcödé",
        "日本",
        "語",
        "x1",
        "42",
        "123456",
        "3.14",
        "'s",
        "'T",
        "'ll",
        "n't",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\r\n",
        "\n\n",
        " \n ",
        "\u{a0}",
        "\u{3000}",
        "\u{2028}",
        ",",
        ".",
        "!?",
        "...",
        "—",
        "\"",
        "'",
        "(",
        ")",
        "{\"k\": 1}",
        "<",
        ">",
        "/",
        "\\",
        "🚀",
        "👍🏽",
        "\u{200b}",
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
        "<|eot|>",
        "[tool]",
        "<s",
        "s>",
        "\u{1}",
        "\u{7f}",
    ];
    let n = 1 + rng.next() % 24;
    (0..n)
        .map(|_| PIECES[(rng.next() % PIECES.len() as u64) as usize])
        .collect()
}

fn agrees_on_random_texts(e: &Encoder, seed: u64, count: usize) {
    assert!(e.is_direct(), "the direct path is in use");
    let mut rng = Rng(seed);
    for _ in 0..count {
        let text = random_text(&mut rng);
        for special in [false, true] {
            assert_eq!(
                e.encode(&text, special),
                e.slow(&text, special),
                "{text:?} (special tokens: {special})"
            );
        }
    }
}

#[test]
fn gpt2_byte_level_matches_the_pipeline() {
    let e = encoder(&fixture_json());
    agrees_on_random_texts(&e, 1, 3000);
}

#[test]
fn a_regex_split_before_byte_level_matches_the_pipeline() {
    let mut json = fixture_json();
    json["pre_tokenizer"] = serde_json::json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]
    });
    json["model"]["ignore_merges"] = Json::Bool(true);
    json["post_processor"] = serde_json::json!({
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}],
             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}, "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}}
        ]
    });
    let e = encoder(&json);
    agrees_on_random_texts(&e, 2, 3000);
}

#[test]
fn shapes_it_does_not_reproduce_use_the_pipeline() {
    let mut with_normalizer = fixture_json();
    with_normalizer["normalizer"] = serde_json::json!({"type": "NFC"});
    assert!(!encoder(&with_normalizer).is_direct());

    let mut prefix_space = fixture_json();
    prefix_space["pre_tokenizer"]["add_prefix_space"] = Json::Bool(true);
    let e = encoder(&prefix_space);
    assert!(!e.is_direct());
    assert_eq!(e.encode("hi there", true), e.slow("hi there", true));

    let mut stripping = fixture_json();
    stripping["added_tokens"][1]["lstrip"] = Json::Bool(true);
    assert!(!encoder(&stripping).is_direct());
}

#[test]
fn the_byte_alphabet_is_gpt2s() {
    let a = byte_alphabet();
    assert_eq!(a[b' ' as usize], 'Ġ');
    assert_eq!(a[b'\n' as usize], 'Ċ');
    assert_eq!(a[b'A' as usize], 'A');
    assert_eq!(a[0xAD], 'Ń');
    assert_eq!(a[0], 'Ā');
    let mut sorted: Vec<char> = a.to_vec();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 256, "one character per byte");
}
