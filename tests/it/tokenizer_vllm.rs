//! `sluice::tokenizer` against a real vLLM 0.32: for every request captured by
//! bench/tokenize/capture.py (chat through `/tokenize` and `/v1/chat/completions`, completions
//! prompts through `/tokenize` and `/v1/completions`), the prompt token ids Sluice computes
//! from the same tokenizer folder are the engine's, token for token.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use sluice::tokenizer::Tokenizer;

#[derive(Deserialize)]
struct Capture {
    vllm: Option<String>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    path: String,
    /// The exact body that was sent (its key order reaches the prompt).
    body: String,
    ids: Vec<u32>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

/// The ids Sluice computes for one captured request.
fn ours(t: &Tokenizer, case: &Case) -> Result<Vec<u32>, String> {
    let body: serde_json::Value = serde_json::from_str(&case.body).map_err(|e| e.to_string())?;
    let result = match body.get("prompt").and_then(|p| p.as_str()) {
        Some(prompt) => {
            let special = body.get("add_special_tokens").and_then(|v| v.as_bool());
            t.prompt_ids(prompt, special.unwrap_or(true))
        }
        None => t.chat_ids(case.body.as_bytes()),
    };
    result.map_err(|e| e.to_string())
}

fn compare(fixture: &str) {
    let t = Tokenizer::load(&fixtures().join(fixture)).unwrap_or_else(|e| panic!("{fixture}: {e}"));
    let file = fixtures().join(format!("{fixture}.vllm.json"));
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
    let capture: Capture = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(capture.vllm.as_deref(), Some("0.32.0"));
    assert!(capture.cases.len() >= 20, "{} cases", capture.cases.len());
    let mut wrong = Vec::new();
    for case in &capture.cases {
        match ours(&t, case) {
            Ok(ids) if ids == case.ids => {}
            Ok(ids) => {
                let at = ids
                    .iter()
                    .zip(&case.ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                wrong.push(format!(
                    "{} ({}): {} ids, vLLM {}; first difference at {at}: ours {:?}, vLLM {:?}",
                    case.name,
                    case.path,
                    ids.len(),
                    case.ids.len(),
                    &ids[at..(at + 8).min(ids.len())],
                    &case.ids[at..(at + 8).min(case.ids.len())],
                ));
            }
            Err(e) => wrong.push(format!("{} ({}): {e}", case.name, case.path)),
        }
    }
    assert!(wrong.is_empty(), "{fixture}:\n{}", wrong.join("\n"));
}

#[test]
fn tool_template_in_tokenizer_config_matches_vllm() {
    compare("tiny-tools");
}

#[test]
fn parts_template_in_chat_template_jinja_matches_vllm() {
    compare("tiny-parts");
}
