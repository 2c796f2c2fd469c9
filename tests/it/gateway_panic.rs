//! A panic in a request handler is answered with an OpenAI-shaped 500, counted, and the
//! process keeps serving (debug builds honour the test-only panic header).

use crate::support;

use serde_json::Value;
use sluice::sim::SimKind;
use support::*;

#[tokio::test]
async fn a_panicking_handler_gets_a_500_and_the_gateway_keeps_serving() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::start_healthy(&format!(
        "{FAST_HEALTH}{}",
        backend("b", "vllm", &s.url(), &["m"])
    ))
    .await;
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
    let resp = client()
        .post(g.url("/v1/chat/completions"))
        .json(&chat_body("m", false, 2))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let metrics = g.metrics_text().await;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("sluice_panics_total"))
        .unwrap_or("");
    let n: f64 = line
        .split_whitespace()
        .last()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0.0);
    assert!(n >= 3.0, "panics counted: {line:?}");
    g.stop().await;
}
