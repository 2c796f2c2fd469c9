//! How long `sluice::tokenizer` takes to turn a long chat request into prompt token ids, the
//! work the gateway will do on its request path: render the chat template, then encode.
//!
//! The request: a multi-turn chat of about 8,000 prompt tokens (a system prompt, then user and
//! assistant turns of English-like text drawn from a fixed seed), with two tools, rendered by
//! a tokenizer fixture folder (default tests/fixtures/tokenizer/tiny-tools). It is timed over
//! a bounded number of iterations after a warm-up; p50 and p99 are printed for the whole
//! `chat_ids` call and, for comparison, for encoding text of the same length alone
//! (`prompt_ids`) and for the body's JSON parse alone. The first call after loading is timed
//! on its own: it meets every word for the first time (the BPE merges run; later calls find
//! the words' ids remembered).
//!
//! Run (release mode, from the repository root):
//!   cargo run --release --example tokenize-speed [-- FOLDER [ITERATIONS]]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sluice::tokenizer::Tokenizer;

/// The allocator the `sluice` binary uses (src/main.rs), so allocation costs are the gateway's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WORDS: &[&str] = &[
    "the",
    "license",
    "software",
    "copyright",
    "permission",
    "notice",
    "shall",
    "be",
    "included",
    "in",
    "all",
    "copies",
    "or",
    "substantial",
    "portions",
    "of",
    "provided",
    "as",
    "is",
    "without",
    "warranty",
    "any",
    "kind",
    "express",
    "implied",
    "including",
    "but",
    "not",
    "limited",
    "to",
    "warranties",
    "merchantability",
    "fitness",
    "for",
    "a",
    "particular",
    "purpose",
    "and",
    "noninfringement",
    "event",
    "authors",
    "holders",
    "liable",
    "claim",
    "damages",
    "other",
    "liability",
    "whether",
    "action",
    "contract",
    "tort",
    "otherwise",
    "arising",
    "from",
    "out",
    "connection",
    "with",
    "use",
    "dealings",
    "you",
    "may",
    "obtain",
    "work",
    "source",
    "form",
    "object",
    "distribution",
    "modification",
    "terms",
    "conditions",
    "version",
    "2.0",
    "Apache",
    "GNU",
    "General",
    "Public",
    "License",
    "free",
    "redistribute",
];

/// SplitMix64, so the chat is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn sentence(&mut self, words: usize) -> String {
        let mut s = String::new();
        for i in 0..words {
            if i > 0 {
                s.push(' ');
            }
            s.push_str(WORDS[(self.next() % WORDS.len() as u64) as usize]);
        }
        s.push('.');
        s
    }
}

/// A chat of `turns` user/assistant turns, and the text of its messages joined.
fn chat(turns: usize) -> (String, String) {
    let mut rng = Rng(7);
    let mut messages = vec![serde_json::json!({
        "role": "system", "content": rng.sentence(60)
    })];
    for _ in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": rng.sentence(40)}));
        messages.push(serde_json::json!({"role": "assistant", "content": rng.sentence(120)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": rng.sentence(30)}));
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "search", "description": "Search the documents.",
         "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
        {"type": "function", "function": {"name": "fetch", "description": "Fetch one document.",
         "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}}
    ]);
    let text: Vec<&str> = messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect();
    let text = text.join("\n");
    let body = serde_json::json!({"model": "m", "messages": messages, "tools": tools});
    (body.to_string(), text)
}

/// p50 and p99 of `iterations` calls of `f`, after a tenth as many unmeasured.
fn time(iterations: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..iterations / 10 {
        f();
    }
    let mut samples: Vec<Duration> = (0..iterations)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    (at(0.50), at(0.99))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let folder = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("tests/fixtures/tokenizer/tiny-tools"));
    let iterations: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1000);
    let t = Tokenizer::load(&folder)?;
    // the smallest number of turns that reaches 8,000 prompt tokens (counted by a second
    // tokenizer, so the first call of `t` meets every word for the first time)
    let counter = Tokenizer::load(&folder)?;
    let mut turns = 1;
    let (body, text, tokens) = loop {
        let (body, text) = chat(turns);
        let n = counter.chat_ids(body.as_bytes())?.len();
        if n >= 8000 || turns > 1000 {
            break (body, text, n);
        }
        turns += 1;
    };
    let start = Instant::now();
    t.chat_ids(body.as_bytes())?;
    let first = start.elapsed();
    let text_tokens = t.prompt_ids(&text, false)?.len();
    println!(
        "{}: {turns} turns, body {} bytes, {tokens} prompt tokens; {iterations} iterations",
        folder.display(),
        body.len()
    );
    let report = |what: &str, (p50, p99): (Duration, Duration)| {
        println!(
            "{what:<44} p50 {:>8.3} ms   p99 {:>8.3} ms",
            p50.as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3
        );
    };
    println!(
        "{:<44} {:>8.3} ms",
        "first chat_ids call (no word seen yet)",
        first.as_secs_f64() * 1e3
    );
    report(
        "chat_ids (parse + render + encode)",
        time(iterations, || {
            let _ = std::hint::black_box(t.chat_ids(body.as_bytes()));
        }),
    );
    report(
        &format!("prompt_ids of the message texts ({text_tokens} tokens)"),
        time(iterations, || {
            let _ = std::hint::black_box(t.prompt_ids(&text, false));
        }),
    );
    report(
        "JSON parse of the body alone",
        time(iterations, || {
            let _ = std::hint::black_box(serde_json::from_str::<serde_json::Value>(&body));
        }),
    );
    Ok(())
}
