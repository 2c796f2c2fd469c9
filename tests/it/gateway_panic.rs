//! A panic in a request handler is answered with an OpenAI-shaped 500, counted, and the
//! process keeps serving (debug builds honour the test-only panic header).

use crate::support;

use serde_json::Value;
use sluice::sim::SimKind;
use support::*;

#[tokio::test]
async fn a_panicking_handler_gets_a_500_and_the_gateway_keeps_serving() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::one_backend("b", "vllm", &s.url()).await;
    // The counter is process-wide: count this test's panics from what it was before them.
    let before = panics(&panics_line(&g).await);
    for _ in 0..3 {
        let resp = client()
            .post(g.url("/v1/chat/completions"))
            .header(sluice::server::guard::TEST_PANIC_HEADER, "1")
            .header("x-request-id", "panic-req-1")
            .json(&chat_body("m", false, 2))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 500);
        assert_eq!(resp.headers()["x-request-id"], "panic-req-1");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["type"], "server_error");
        assert_eq!(v["error"]["code"], "internal_error");
    }
    let resp = g.chat(&chat_body("m", false, 2)).await;
    assert_eq!(resp.status(), 200);
    let line = panics_line(&g).await;
    let n = panics(&line) - before;
    assert!(n >= 3.0, "panics counted: {line:?}");
    g.stop().await;
}

async fn panics_line(g: &TestGateway) -> String {
    let metrics = g.metrics_text().await;
    metrics
        .lines()
        .find(|l| l.starts_with("sluice_panics_total"))
        .unwrap_or("")
        .to_string()
}

fn panics(line: &str) -> f64 {
    line.split_whitespace()
        .last()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0.0)
}
