//! Exact prompt counts (`[routing] tokenize_above`): a large prompt is counted by a vLLM
//! backend's tokenizer and that count is what the request reserves of its key's token limit;
//! a small one keeps the estimate; a tokenizer that fails, hangs or does not exist leaves the
//! estimate and never fails the request. The reservation is read back from
//! `x-ratelimit-remaining-tokens` (limit − reserved, one fresh key per request).

use crate::support;

use std::time::{Duration, Instant};

use sluice::sim::SimKind;
use support::{backend, client, header, metric, sim, TestGateway};

const LIMIT: u64 = 1_000_000;
const MAX_TOKENS: u64 = 8;

/// A key with its own token limit, and its config block.
fn key(name: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    (
        key,
        format!("\n[[keys]]\nname = \"{name}\"\nhash = \"{hash}\"\ntokens_per_minute = {LIMIT}\n"),
    )
}

/// A prompt the simulator's tokenizer counts at about one token a byte (punctuation), four
/// times the tokenizer-free estimate.
fn dense_prompt(bytes: usize) -> String {
    "!?".repeat(bytes / 2)
}

/// Send a chat; (tokens reserved for it, prompt tokens the backend reported, elapsed).
async fn reserved(g: &TestGateway, key: &str, content: &str) -> (u64, u64, Duration) {
    let started = Instant::now();
    let r = client()
        .post(g.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&serde_json::json!({
            "model": "m",
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": content}]
        }))
        .send()
        .await
        .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(r.status(), 200);
    let remaining: u64 = header(&r, "x-ratelimit-remaining-tokens").parse().unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    (LIMIT - remaining, prompt, elapsed)
}

async fn tokenize_count(g: &TestGateway, backend: &str, outcome: &str) -> f64 {
    let text = g.metrics_text().await;
    let series =
        format!("sluice_tokenize_requests_total{{backend=\"{backend}\",outcome=\"{outcome}\"}}");
    metric(&text, &series)
}

#[tokio::test]
async fn a_large_prompt_reserves_its_exact_count_and_a_small_one_its_estimate() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let (small_key, k1) = key("small");
    let (large_key, k2) = key("large");
    let g = TestGateway::start_healthy(&format!(
        "[routing]\ntokenize_above = 200\n{}{k1}{k2}",
        backend("tok-vllm", "vllm", &s.url(), &["m"])
    ))
    .await;

    // Under the threshold: the estimate (a quarter of the real count here), no question asked.
    let (held, prompt, _) = reserved(&g, &small_key, &dense_prompt(200)).await;
    assert!(prompt > 150, "the sim counts ~1 token a byte: {prompt}");
    assert!(
        held < prompt,
        "a small prompt reserves its estimate ({held}), not its count ({prompt})"
    );
    assert_eq!(tokenize_count(&g, "tok-vllm", "ok").await, 0.0);

    // Over it: exactly what the backend then reports as the prompt, plus max_tokens.
    let (held, prompt, _) = reserved(&g, &large_key, &dense_prompt(4000)).await;
    assert_eq!(held, prompt + MAX_TOKENS);
    assert_eq!(tokenize_count(&g, "tok-vllm", "ok").await, 1.0);
    g.stop().await;
}

#[tokio::test]
async fn a_failing_or_missing_tokenizer_leaves_the_estimate() {
    // A TGI server listed as vLLM: it serves the chat, but its /tokenize rejects vLLM's form.
    let tgi = sim(SimKind::Tgi, &["m"]).await;
    let (k, block) = key("failing");
    let g = TestGateway::start_healthy(&format!(
        "[routing]\ntokenize_above = 200\n{}{block}",
        backend("tok-tgi-as-vllm", "vllm", &tgi.url(), &["m"])
    ))
    .await;
    let (held, prompt, _) = reserved(&g, &k, &dense_prompt(4000)).await;
    assert!(held < prompt, "estimate kept: {held} vs {prompt}");
    assert_eq!(tokenize_count(&g, "tok-tgi-as-vllm", "error").await, 1.0);
    g.stop().await;

    // Only an Ollama server: nobody to ask.
    let ollama = sim(SimKind::Ollama, &["m"]).await;
    let (k, block) = key("none");
    let g = TestGateway::start_healthy(&format!(
        "[routing]\ntokenize_above = 200\n{}{block}",
        backend("tok-ollama", "ollama", &ollama.url(), &["m"])
    ))
    .await;
    let before = tokenize_count(&g, "-", "no_backend").await;
    let (held, _, _) = reserved(&g, &k, &dense_prompt(4000)).await;
    assert!(held > 0);
    assert_eq!(tokenize_count(&g, "-", "no_backend").await, before + 1.0);
    g.stop().await;
}

#[tokio::test]
async fn a_hanging_tokenizer_costs_at_most_the_timeout() {
    use axum::routing::{get, post};
    // A vLLM-shaped server whose /tokenize never answers.
    let app = axum::Router::new()
        .route("/health", get(|| async { "" }))
        .route(
            "/tokenize",
            post(|| async {
                std::future::pending::<()>().await;
                ""
            }),
        )
        .route(
            "/v1/chat/completions",
            post(|| async {
                axum::Json(serde_json::json!({
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "ok"}}],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
                }))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let (k, block) = key("hanging");
    let g = TestGateway::start_healthy(&format!(
        "[routing]\ntokenize_above = 200\ntokenize_timeout = \"300ms\"\n{}{block}",
        backend("tok-hang", "vllm", &url, &["m"])
    ))
    .await;
    let (held, _, elapsed) = reserved(&g, &k, &dense_prompt(4000)).await;
    assert!(held > 0);
    assert!(
        elapsed >= Duration::from_millis(300) && elapsed < Duration::from_secs(5),
        "answered after {elapsed:?}"
    );
    assert_eq!(tokenize_count(&g, "tok-hang", "timeout").await, 1.0);
    g.stop().await;
}
