//! Every error a client can get from the gateway itself, and backend errors passed through
//! with their status and an OpenAI-shaped body. Plus the headers that cross the gateway.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice::sim::{Fault, FaultMode, SimKind};
use support::*;

async fn vllm_gateway(extra: &str) -> (TestGateway, sluice::sim::SimHandle) {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::start_healthy(&format!(
        "{extra}\n{FAST_HEALTH}{}",
        backend("b", "vllm", &s.url(), &["m"])
    ))
    .await;
    (g, s)
}

/// A response that tells the client not to reuse its connection.
fn closing(resp: reqwest::Response) -> reqwest::Response {
    assert_eq!(resp.headers()["connection"], "close");
    resp
}

async fn expect_error(resp: reqwest::Response, status: u16, code: Option<&str>) -> Value {
    assert_eq!(resp.status().as_u16(), status);
    assert!(header(&resp, "content-type").starts_with("application/json"));
    let v: Value = resp.json().await.unwrap();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    if let Some(code) = code {
        assert_eq!(e["code"], code, "{v}");
    }
    v
}

#[tokio::test]
async fn client_errors_are_openai_shaped_with_the_right_status() {
    let (g, _s) = vllm_gateway("[server]\nmax_body_bytes = 4096\n").await;
    // A pooled client: a 413 says `connection: close` (the refused body is still on the
    // connection), so the next request never goes out on a connection the gateway is closing.
    let c = client();
    let post = |body: &'static str| {
        c.post(g.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body)
    };
    expect_error(
        post("{not json").send().await.unwrap(),
        400,
        Some("invalid_json"),
    )
    .await;
    let v = expect_error(
        post(r#"{"messages":[{"role":"user","content":"x"}]}"#)
            .send()
            .await
            .unwrap(),
        400,
        None,
    )
    .await;
    assert_eq!(v["error"]["param"], "model");
    expect_error(
        post(r#"{"model":7,"messages":[{"role":"user","content":"x"}]}"#)
            .send()
            .await
            .unwrap(),
        400,
        None,
    )
    .await;
    let v = expect_error(
        post(r#"{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}"#)
            .send()
            .await
            .unwrap(),
        404,
        Some("model_not_found"),
    )
    .await;
    assert!(v["error"]["message"].as_str().unwrap().contains("gpt-9"));
    // Too large, by Content-Length and by chunked streaming without a length.
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(10_000)
    );
    expect_error(
        closing(
            c.post(g.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(big.clone())
                .send()
                .await
                .unwrap(),
        ),
        413,
        Some("request_too_large"),
    )
    .await;
    let stream =
        futures_util::stream::iter((0..20).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1000])));
    expect_error(
        closing(
            c.post(g.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(reqwest::Body::wrap_stream(stream))
                .send()
                .await
                .unwrap(),
        ),
        413,
        Some("request_too_large"),
    )
    .await;
    expect_error(
        c.post(g.url("/v1/chat/completions"))
            .header("content-type", "text/plain")
            .body("{}")
            .send()
            .await
            .unwrap(),
        415,
        Some("unsupported_media_type"),
    )
    .await;
    expect_error(
        c.get(g.url("/v1/chat/completions")).send().await.unwrap(),
        405,
        Some("method_not_allowed"),
    )
    .await;
    expect_error(
        c.get(g.url("/v2/nothing")).send().await.unwrap(),
        404,
        Some("unknown_url"),
    )
    .await;
    // Wrong types of routed fields.
    for body in [
        r#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}"#,
        r#"{"model":"m","max_tokens":-5,"messages":[{"role":"user","content":"x"}]}"#,
        r#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#,
        r#"[]"#,
        "",
    ] {
        expect_error(post(body).send().await.unwrap(), 400, None).await;
    }
    // The gateway still serves after all that.
    let resp = post_json(&c, g.url("/v1/chat/completions"), &chat_body("m", false, 2)).await;
    assert_eq!(resp.status(), 200);
    g.stop().await;
}

#[tokio::test]
async fn no_backend_available_is_503_with_retry_after_fast() {
    let port = free_port();
    let g = TestGateway::start(&format!(
        "{FAST_HEALTH}{}",
        backend("gone", "vllm", &format!("http://127.0.0.1:{port}"), &["m"])
    ))
    .await;
    let started = Instant::now();
    let resp = g.chat(&chat_body("m", false, 2)).await;
    assert!(resp.headers().get("retry-after").is_some());
    expect_error(resp, 503, None).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // Once the probe knows, the answer is immediate and says no backend is available.
    g.wait_state("gone", "starting", Duration::from_secs(5))
        .await;
    let resp = g.chat(&chat_body("m", false, 2)).await;
    assert_eq!(resp.headers()["retry-after"], "1");
    expect_error(resp, 503, Some("no_backend_available")).await;
    g.stop().await;
}

#[tokio::test]
async fn backend_timeout_is_504() {
    let (g, s) =
        vllm_gateway("[routing]\nmax_attempts = 1\n[timeouts]\nresponse = \"300ms\"\n").await;
    s.set_fault(Fault::mode(FaultMode::Hang)).unwrap();
    let started = Instant::now();
    let resp = g.chat(&chat_body("m", false, 2)).await;
    expect_error(resp, 504, Some("backend_timeout")).await;
    assert!(started.elapsed() < Duration::from_secs(3));
    s.set_fault(Fault::healthy()).unwrap();
    g.stop().await;
}

#[tokio::test]
async fn backend_errors_pass_through_normalised() {
    // vLLM's own 400 (max_tokens below 1) keeps its status and message; the integer code
    // becomes a string so OpenAI SDKs parse it. (A max_tokens beyond the context is refused
    // by the gateway itself once it knows the window, in the same words: tests/it/zero_context.rs.)
    let (g, _s) = vllm_gateway("").await;
    let resp = g.chat(&chat_body("m", false, 0)).await;
    let v = expect_error(resp, 400, Some("400")).await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"),
        "{v}"
    );
    g.stop().await;

    // TGI's {error, error_type} body becomes OpenAI-shaped.
    let b = ScriptedBackend::start(
        422,
        vec![("content-type", "application/json".into())],
        r#"{"error":"Input validation error: `inputs` must have less than 1024 tokens. Given: 1500","error_type":"validation"}"#.into(),
    )
    .await;
    let g = TestGateway::one_backend("t", "openai", &b.url()).await;
    let resp = g.chat(&chat_body("m", false, 5)).await;
    let v = expect_error(resp, 422, None).await;
    assert_eq!(v["error"]["type"], "validation");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Input validation error"));
    g.stop().await;

    // A backend 500 is passed through (not retried: the engine is up and said so).
    let b = ScriptedBackend::start(500, vec![], "boom".into()).await;
    let g = TestGateway::one_backend("t", "openai", &b.url()).await;
    let resp = g.chat(&chat_body("m", false, 5)).await;
    let v = expect_error(resp, 500, None).await;
    assert_eq!(v["error"]["message"], "boom");
    assert_eq!(b.inference_requests().len(), 1);
    g.stop().await;
}

#[tokio::test]
async fn headers_crossing_the_gateway() {
    let b = ScriptedBackend::start(
        200,
        vec![
            ("content-type", "application/json".into()),
            ("connection", "x-private".into()),
            ("x-private", "hop".into()),
            ("x-compute-time", "12".into()),
        ],
        r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"backend-name","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#.into(),
    )
    .await;
    let mut t = format!("{FAST_HEALTH}{}", backend("t", "openai", &b.url(), &["m"]));
    t.push_str("api_key = \"backend-secret\"\nmodel_names = { \"m\" = \"backend-name\" }\n");
    let g = TestGateway::start_healthy(&t).await;
    let resp = client()
        .post(g.url("/v1/chat/completions"))
        .header("authorization", "Bearer client-secret")
        .header("cookie", "session=1")
        .header("x-request-id", "req-abc-123")
        .header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .json(&chat_body("m", false, 5))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-abc-123");
    assert_eq!(resp.headers()["x-compute-time"], "12");
    assert!(
        resp.headers().get("x-private").is_none(),
        "hop-by-hop header leaked"
    );
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["model"], "m", "response carries the client's model name");

    let seen = b.inference_requests();
    assert_eq!(seen.len(), 1);
    let h = &seen[0].headers;
    assert_eq!(
        h["authorization"], "Bearer backend-secret",
        "the backend's key, never the client's"
    );
    assert!(h.get("cookie").is_none());
    assert_eq!(h["x-request-id"], "req-abc-123");
    assert!(h.get("traceparent").is_some());
    let sent: Value = serde_json::from_slice(&seen[0].body).unwrap();
    assert_eq!(sent["model"], "backend-name", "per-backend model name");

    // Without a client id, one is generated and returned.
    let resp = g.chat(&chat_body("m", false, 5)).await;
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(id.len(), 32);
    assert_eq!(
        b.inference_requests()[1].headers["x-request-id"],
        id.as_str()
    );
    g.stop().await;
}

#[tokio::test]
async fn retryable_failures_go_to_the_next_backend_before_anything_was_sent() {
    let busy = ScriptedBackend::start(
        503,
        vec![
            ("content-type", "application/json".into()),
            ("retry-after", "30".into()),
        ],
        r#"{"error":{"message":"server busy","type":"api_error","param":null,"code":null}}"#.into(),
    )
    .await;
    let good = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::start_healthy(&format!(
        "[routing]\npolicy = \"round-robin\"\n{FAST_HEALTH}{}{}",
        backend("busy", "openai", &busy.url(), &["m"]),
        backend("good", "vllm", &good.url(), &["m"])
    ))
    .await;
    for _ in 0..6 {
        let resp = g.chat(&chat_body("m", false, 2)).await;
        assert_eq!(resp.status(), 200);
    }
    // Retry-After: 30 means the busy backend is skipped after its first 503.
    assert_eq!(busy.inference_requests().len(), 1);
    let _ = json!({});
    g.stop().await;
}
