//! Backends that misbehave in the middle of an answer: a stream that stalls, a connection
//! closed mid-chunk, a stream that ends without finishing, an endless event, an endless header.
//! The affected client always gets a clean, OpenAI-shaped end; nothing hangs; the gateway keeps
//! serving.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::raw::{bad_backend, Misbehaviour};
use support::*;

async fn gateway_for(url: &str) -> TestGateway {
    TestGateway::start_healthy(&format!(
        "[routing]\nmax_attempts = 1\n[timeouts]\nidle = \"300ms\"\nfirst_byte = \"2s\"\n{FAST_HEALTH}{}",
        backend("bad", "openai", url, &["m"])
    ))
    .await
}

/// Stream `m` through the gateway; returns the payloads received.
async fn stream(g: &TestGateway) -> (u16, Vec<String>) {
    let resp = g.chat(&chat_body("m", true, 20)).await;
    let status = resp.status().as_u16();
    let body = resp.text().await.unwrap();
    (status, sse_data(&body))
}

fn assert_terminal_error(data: &[String]) {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], "backend_stream_interrupted", "{err}");
    assert_eq!(err["error"]["type"], "server_error");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("incomplete"));
}

#[tokio::test]
async fn mid_stream_failures_end_with_a_terminal_error_event() {
    for how in [
        Misbehaviour::Stall,
        Misbehaviour::CloseMidChunk,
        Misbehaviour::EndEarly,
        Misbehaviour::EndlessEvent,
    ] {
        let url = bad_backend(how).await;
        let g = gateway_for(&url).await;
        let started = Instant::now();
        let (status, data) = stream(&g).await;
        assert_eq!(status, 200, "{how:?}");
        assert_terminal_error(&data);
        if !matches!(how, Misbehaviour::EndlessEvent) {
            // the first event arrived intact before the error
            let first: Value = serde_json::from_str(&data[0]).unwrap();
            assert_eq!(first["choices"][0]["delta"]["content"], "Hi", "{how:?}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{how:?} took {:?}",
            started.elapsed()
        );
        // The backend is marked by the failure.
        let rt = g.gw.runtime();
        let b = rt.fleet.get("bad").unwrap();
        assert!(b.state.failures_total() >= 1, "{how:?}");
        g.stop().await;
    }
}

#[tokio::test]
async fn endless_response_header_is_a_clean_502() {
    let url = bad_backend(Misbehaviour::EndlessHeader).await;
    let g = gateway_for(&url).await;
    let started = Instant::now();
    let resp = g.chat(&chat_body("m", false, 5)).await;
    let status = resp.status().as_u16();
    assert!(status == 502 || status == 504, "status {status}");
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].is_string());
    assert!(started.elapsed() < Duration::from_secs(5));
    g.stop().await;
}

#[tokio::test]
async fn one_broken_backend_does_not_hurt_other_requests() {
    let bad = bad_backend(Misbehaviour::Stall).await;
    let good = sim(sluice::sim::SimKind::Vllm, &["ok"]).await;
    let g = TestGateway::start_healthy(&format!(
        "[timeouts]\nidle = \"2s\"\n{FAST_HEALTH}{}{}",
        backend("bad", "openai", &bad, &["m"]),
        backend("good", "vllm", &good.url(), &["ok"])
    ))
    .await;
    // Ten stalled streams open at once…
    let mut stalled = Vec::new();
    for _ in 0..10 {
        let c = client();
        let url = g.url("/v1/chat/completions");
        stalled.push(tokio::spawn(async move {
            c.post(url)
                .json(&chat_body("m", true, 20))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }));
    }
    // …while the other model keeps answering promptly.
    for _ in 0..20 {
        let started = Instant::now();
        let resp = g.chat(&chat_body("ok", false, 3)).await;
        assert_eq!(resp.status(), 200);
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    for s in stalled {
        let body = s.await.unwrap();
        assert_terminal_error(&sse_data(&body));
    }
    g.stop().await;
}
