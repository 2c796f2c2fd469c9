//! Backends that answer badly: bytes that are not HTTP, an impossible or gigantic chunk size,
//! invalid SSE (lines without `data:`, data that is not JSON, binary bytes), NDJSON where JSON
//! or SSE belongs, a body that never ends (fast or trickling), a `Content-Length` larger than
//! what is sent. In every case the affected client gets a clean OpenAI-shaped error (a 502
//! before the answer started, a terminal SSE error event after), a healthy request running at
//! the same time on another backend is served promptly, and the broken backend's passive
//! health counts the failure.
//!
//! Caps under test: `server.max_response_bytes` (whole non-streamed answers), the per-event SSE
//! cap (8 MiB, chunk sizes in the HTTP framing do not matter: bytes are read as they come),
//! `timeouts.idle` between chunks and `timeouts.response` for a whole non-streamed answer.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::Value;
use support::raw::{bad_backend, Misbehaviour as Bad, EVENT};
use support::*;

/// A gateway with the broken backend for `m` and a healthy simulator for `ok`.
async fn gateway(bad_url: &str, kind: &str) -> (TestGateway, sluice::sim::SimHandle) {
    let good = sim(sluice::sim::SimKind::Vllm, &["ok"]).await;
    let g = TestGateway::start_healthy(&format!(
        "[server]\nmax_response_bytes = 1048576\n[routing]\nmax_attempts = 1\n\
         [timeouts]\nidle = \"300ms\"\nfirst_byte = \"2s\"\nresponse = \"1500ms\"\n{FAST_HEALTH}{}{}",
        backend("bad", kind, bad_url, &["m"]),
        backend("good", "vllm", &good.url(), &["ok"])
    ))
    .await;
    (g, good)
}

/// The broken answer came within 5 s, and passive health counted it against `bad`.
#[track_caller]
fn quick_and_seen(g: &TestGateway, how: Bad, started: Instant) {
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{how:?} took {:?}",
        started.elapsed()
    );
    assert!(
        failures(g, "bad") >= 1,
        "{how:?}: passive health saw nothing"
    );
}

fn failures(g: &TestGateway, name: &str) -> u64 {
    let rt = g.gw.runtime();
    rt.fleet
        .get(name)
        .map(|b| b.state.failures_total())
        .unwrap_or(0)
}

/// Healthy requests on the other backend while `bad` runs: each answered promptly.
async fn healthy_meanwhile(g: &TestGateway) {
    for _ in 0..5 {
        let started = Instant::now();
        let resp = g.chat(&chat_body("ok", false, 3)).await;
        assert_eq!(resp.status(), 200);
        let _ = resp.bytes().await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }
}

async fn request(g: &TestGateway, stream: bool) -> (u16, String, String) {
    request_with(g, chat_body("m", stream, 20)).await
}

/// A streamed request with `include_usage` on: the gateway injects nothing, so the stream is
/// passed through untouched (the zero-copy path); without it the usage chunk is injected and
/// stripped (the editing path).
fn passthrough_body() -> Value {
    let mut b = chat_body("m", true, 20);
    b["stream_options"] = serde_json::json!({"include_usage": true});
    b
}

async fn request_with(g: &TestGateway, body: Value) -> (u16, String, String) {
    let resp = g.chat(&body).await;
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = resp.text().await.unwrap_or_default();
    (status, ct, body)
}

fn assert_terminal_error(how: Bad, body: &str) {
    let data = sse_data(body);
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "{how:?}: {body:.400}"
    );
    let err: Value = serde_json::from_str(&data[data.len() - 2])
        .unwrap_or_else(|e| panic!("{how:?}: the error event is not JSON ({e}): {body:.400}"));
    assert_eq!(
        err["error"]["code"], "backend_stream_interrupted",
        "{how:?}: {err}"
    );
    // Every event before it is JSON an SDK can parse: nothing broken was passed on.
    for d in &data[..data.len() - 2] {
        let v: Value = serde_json::from_str(d).unwrap_or_else(|e| {
            panic!("{how:?}: a broken event reached the client ({e}): {d:.200}")
        });
        assert_eq!(v["choices"][0]["delta"]["content"], "Hi", "{how:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_non_streamed_answers_are_clean_502s() {
    for how in [
        Bad::Garbage,
        Bad::OverflowChunkSize,
        Bad::GiantChunkJson,
        Bad::Ndjson,
        Bad::InvalidJson,
        Bad::EndlessBody,
        Bad::TrickleBody,
        Bad::ShortLength,
    ] {
        let url = bad_backend(how).await;
        let kind = if how == Bad::Ndjson {
            "ollama"
        } else {
            "openai"
        };
        let (g, _good) = gateway(&url, kind).await;
        let started = Instant::now();
        let ((status, ct, body), ()) = tokio::join!(request(&g, false), healthy_meanwhile(&g));
        assert_eq!(status, 502, "{how:?}: {body:.300}");
        assert!(ct.starts_with("application/json"), "{how:?}: {ct}");
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{how:?}: {e}: {body:.300}"));
        assert_eq!(v["error"]["type"], "server_error", "{how:?}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("bad")),
            "{how:?}: {v}"
        );
        assert!(
            body.len() < 4096,
            "{how:?}: the backend's bytes were passed on"
        );
        quick_and_seen(&g, how, started);
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_streams_end_with_a_terminal_error_event() {
    for (how, passthrough) in [
        Bad::GiantChunkSse,
        Bad::SseNoData,
        Bad::SseInvalidJson,
        Bad::SseBinary,
        Bad::SseShortLength,
    ]
    .into_iter()
    .flat_map(|h| [(h, false), (h, true)])
    {
        let url = bad_backend(how).await;
        let (g, _good) = gateway(&url, "openai").await;
        let started = Instant::now();
        let body = if passthrough {
            passthrough_body()
        } else {
            chat_body("m", true, 20)
        };
        let ((status, ct, body), ()) = tokio::join!(request_with(&g, body), healthy_meanwhile(&g));
        assert_eq!(status, 200, "{how:?}");
        assert!(ct.starts_with("text/event-stream"), "{how:?}: {ct}");
        assert_terminal_error(how, &body);
        assert!(
            body.len() < 64 * 1024,
            "{how:?}: {} bytes reached the client",
            body.len()
        );
        assert!(
            !body.contains("oops"),
            "{how:?}: the invalid event was passed on"
        );
        quick_and_seen(&g, how, started);
        g.stop().await;
    }
}

#[tokio::test]
async fn a_streamed_request_to_a_garbage_backend_is_a_502_before_any_byte() {
    let url = bad_backend(Bad::Garbage).await;
    let (g, _good) = gateway(&url, "openai").await;
    let (status, ct, body) = request(&g, true).await;
    assert_eq!(status, 502, "{body}");
    assert!(ct.starts_with("application/json"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "backend_error");
    g.stop().await;
}

#[tokio::test]
async fn garbage_backend_fails_over_and_is_ejected() {
    let url = bad_backend(Bad::Garbage).await;
    let good = sim(sluice::sim::SimKind::Vllm, &["m"]).await;
    // One probe at start only: a healthy probe between the two failures would reset their
    // streak (and a third failure would be needed), however slow the machine is.
    let g = TestGateway::start_healthy(&format!(
        "[routing]\npolicy = \"round-robin\"\n[health]\ninterval = \"1h\"\ntimeout = \"500ms\"\nhealthy_threshold = 1\nunhealthy_threshold = 1\neject_after_failures = 2\nbase_ejection = \"30s\"\n{}{}",
        backend("bad", "openai", &url, &["m"]),
        backend("good", "vllm", &good.url(), &["m"])
    ))
    .await;
    for _ in 0..6 {
        let resp = g.chat(&chat_body("m", false, 3)).await;
        assert_eq!(resp.status(), 200, "failover to the good backend");
    }
    g.wait_state("bad", "ejected", Duration::from_secs(5)).await;
    let rt = g.gw.runtime();
    let bad = rt.fleet.get("bad").unwrap();
    assert_eq!(bad.state.failures_total(), 2);
    assert!(bad.state.track().ejections >= 1);
    g.stop().await;
}

#[tokio::test]
async fn events_split_across_chunks_arrive_whole_and_unchanged() {
    let url = bad_backend(Bad::SplitGood).await;
    let (g, _good) = gateway(&url, "openai").await;
    let (status, _, body) = request(&g, true).await;
    assert_eq!(status, 200);
    assert_eq!(body, format!("{EVENT}{EVENT}{EVENT}data: [DONE]\n\n"));
    let (status, _, body) = request_with(&g, passthrough_body()).await;
    assert_eq!(status, 200);
    assert_eq!(body, format!("{EVENT}{EVENT}{EVENT}data: [DONE]\n\n"));
    assert_eq!(failures(&g, "bad"), 0);
    g.stop().await;
}

#[tokio::test]
async fn sse_comments_and_unknown_fields_pass_a_healthy_stream() {
    // Lines without `data:` between good events are legal SSE (fields an SDK ignores): the
    // stream completes normally.
    let b = ScriptedBackend::start(
        200,
        vec![("content-type", "text/event-stream".into())],
        format!(": keep-alive\n\nevent: ping\nid: 1\n\n{EVENT}retry: 5\n\n{EVENT}data: [DONE]\n\n"),
    )
    .await;
    let g = TestGateway::one_backend("b", "openai", &b.url()).await;
    let (status, _, body) = request(&g, true).await;
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.len(), 3, "{body}");
    assert_eq!(data[2], "[DONE]");
    assert!(!body.contains("backend_stream_interrupted"), "{body}");
    g.stop().await;
}
