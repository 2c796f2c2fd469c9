//! The vLLM simulator with a real tokenizer (`sluice sim --tokenizer <folder>`): its
//! `/tokenize` answers, its usage and its prefix cache count the prompt token ids a real vLLM
//! 0.32 computes (the captures of bench/tokenize/capture.py in tests/fixtures/tokenizer).

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use sluice::sim::{SimConfig, SimKind, Timing};
use sluice::tokenizer::Tokenizer;

use crate::support::sim::{client, start};

#[derive(Deserialize)]
struct Capture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    path: String,
    body: String,
    ids: Vec<u32>,
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

fn tokenizer() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::load(&fixture("tiny-tools")).expect("fixture tokenizer"))
}

fn captured() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture("tiny-tools.vllm.json")).expect("capture");
    let c: Capture = serde_json::from_str(&text).expect("capture JSON");
    c.cases
}

async fn post(url: String, body: String) -> (u16, serde_json::Value) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.expect("JSON answer"))
}

#[tokio::test]
async fn tokenize_answers_vllms_ids() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(0.0).tokenizer(tokenizer())
    })
    .await;
    // `list_of_parts` has a bare string among its content parts, which vLLM accepts and the
    // simulator's request parsing (shared with TGI and Ollama, which refuse it) does not
    let cases: Vec<Case> = captured()
        .into_iter()
        .filter(|c| c.path == "/tokenize" && c.name != "list_of_parts")
        .collect();
    assert!(cases.len() >= 15);
    for case in cases {
        let (status, v) = post(format!("{}/tokenize", sim.url()), case.body.clone()).await;
        assert_eq!(status, 200, "{}: {v}", case.name);
        let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).expect("tokens");
        assert_eq!(ids, case.ids, "{}", case.name);
        assert_eq!(v["count"], case.ids.len(), "{}", case.name);
    }
    let body = r#"{"model": "tiny", "prompt": "Hello world", "return_token_strs": true}"#;
    let (_, v) = post(format!("{}/tokenize", sim.url()), body.into()).await;
    assert_eq!(v["token_strs"][0], "<s>");
    assert_eq!(v["token_strs"].as_array().map(Vec::len), Some(5));
}

#[tokio::test]
async fn usage_counts_vllms_prompt_tokens() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(0.0).tokenizer(tokenizer())
    })
    .await;
    for case in captured()
        .into_iter()
        .filter(|c| c.path.starts_with("/v1/"))
    {
        let (status, v) = post(format!("{}{}", sim.url(), case.path), case.body.clone()).await;
        assert_eq!(status, 200, "{}: {v}", case.name);
        assert_eq!(v["usage"]["prompt_tokens"], case.ids.len(), "{}", case.name);
    }
}

#[tokio::test]
async fn a_template_refusal_is_vllms_400() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(0.0).tokenizer(tokenizer())
    })
    .await;
    let body = serde_json::json!({"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]});
    let (status, v) = post(
        format!("{}/v1/chat/completions", sim.url()),
        body.to_string(),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("Only the first message may be a system message."),
        "{v}"
    );
    assert_eq!(v["error"]["code"], 400);
}

/// Two chats sharing a long system prompt: the second one's cached tokens are the whole blocks
/// of the real ids the two share, which only the real tokenizer knows.
#[tokio::test]
async fn the_prefix_cache_hashes_the_real_ids() {
    let t = tokenizer();
    let block = 16;
    let timing = Timing {
        block_size: block,
        ..Timing::default()
    };
    let sim = start(SimKind::Vllm, &["tiny"], |c: SimConfig| {
        c.speed(1000.0)
            .timing(timing)
            .prompt_tokens_details(true)
            .tokenizer(t.clone())
    })
    .await;
    let system = "You answer questions about the licence texts. ".repeat(12);
    let chat = |question: &str| {
        serde_json::json!({"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]})
        .to_string()
    };
    let (first, second) = (
        chat("What is a patent grant?"),
        chat("Who may redistribute?"),
    );
    let a = t.chat_ids(first.as_bytes()).expect("ids");
    let b = t.chat_ids(second.as_bytes()).expect("ids");
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count() as u32;
    assert!(shared > 3 * block, "a long shared prefix ({shared} tokens)");
    let url = format!("{}/v1/chat/completions", sim.url());
    let (_, v) = post(url.clone(), first).await;
    assert_eq!(v["usage"]["prompt_tokens"], a.len());
    let (_, v) = post(url, second).await;
    assert_eq!(v["usage"]["prompt_tokens"], b.len());
    let cached = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert_eq!(cached, shared / block * block, "{v}");
}
