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

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Bad {
    /// An SSH banner and random bytes instead of an HTTP response.
    Garbage,
    /// A chunk-size line that overflows any integer.
    OverflowChunkSize,
    /// A JSON answer announced as one 64 MiB chunk, bytes flowing past `max_response_bytes`.
    GiantChunkJson,
    /// An SSE answer announced as one 64 MiB chunk: one good event, then one event that never
    /// ends (past the per-event cap).
    GiantChunkSse,
    /// SSE lines without `data:` only, then the end.
    SseNoData,
    /// A good event, then an event whose data is not JSON, then more good events.
    SseInvalidJson,
    /// A good event, then an event of binary bytes.
    SseBinary,
    /// A good event, then a connection that sends less than its Content-Length.
    SseShortLength,
    /// Ollama's native NDJSON stream where the OpenAI surface's JSON belongs.
    Ndjson,
    /// A 200 JSON body that is not JSON.
    InvalidJson,
    /// A JSON body that never ends, fast.
    EndlessBody,
    /// A JSON body trickling one byte at a time, each faster than `idle`, never ending.
    TrickleBody,
    /// `content-length: 1000` and 100 bytes, then close.
    ShortLength,
    /// Not broken: a good stream whose events are split across chunks at odd places.
    SplitGood,
}

const EVENT: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n";

/// A raw HTTP/1.1 backend answering probes properly and inference requests as `how` says.
async fn bad_backend(how: Bad) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(serve_conn(sock, how));
        }
    });
    format!("http://{addr}")
}

/// Read one request head (and its body, by Content-Length). Returns the request line.
async fn read_request(sock: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    loop {
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = sock.read(&mut tmp).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&tmp[..n]);
            }
            return Some(head.lines().next().unwrap_or("").to_string());
        }
    }
}

async fn serve_conn(mut sock: TcpStream, how: Bad) {
    while let Some(line) = read_request(&mut sock).await {
        if line.starts_with("GET") {
            let body = if line.contains("/api/tags") {
                r#"{"models":[{"name":"m"}]}"#
            } else {
                r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#
            };
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            if sock.write_all(resp.as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        let head = |ct: &str| {
            format!("HTTP/1.1 200 OK\r\ncontent-type: {ct}\r\ntransfer-encoding: chunked\r\n\r\n")
        };
        let chunk = |s: &[u8]| [format!("{:x}\r\n", s.len()).as_bytes(), s, b"\r\n"].concat();
        let sse = head("text/event-stream");
        let json = head("application/json");
        let _ = match how {
            Bad::Garbage => {
                sock.write_all(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe garbage \x01\x02\r\n\r\n")
                    .await
            }
            Bad::OverflowChunkSize => {
                sock.write_all(format!("{json}fffffffffffffffffffffffff\r\n{{}}").as_bytes())
                    .await
            }
            Bad::GiantChunkJson => {
                let _ = sock.write_all(format!("{json}4000000\r\n").as_bytes()).await;
                let block = vec![b' '; 64 * 1024];
                for _ in 0..64 {
                    if sock.write_all(&block).await.is_err() {
                        break;
                    }
                }
                Ok(())
            }
            Bad::GiantChunkSse => {
                let _ = sock
                    .write_all(format!("{sse}4000000\r\n{EVENT}data: ").as_bytes())
                    .await;
                let block = vec![b'x'; 64 * 1024];
                for _ in 0..(10 * 16) {
                    if sock.write_all(&block).await.is_err() {
                        break;
                    }
                }
                Ok(())
            }
            Bad::SseNoData => {
                let body = b"hello\nworld: 1\n\nevent: ping\n\nretry: 10\n\n";
                sock.write_all(&[sse.as_bytes(), &chunk(body), b"0\r\n\r\n"].concat())
                    .await
            }
            Bad::SseInvalidJson => {
                let body = [
                    EVENT.as_bytes(),
                    b"data: {\"choices\":[{\"delta\":{\"content\":\"oops\"\n\n",
                    EVENT.as_bytes(),
                    b"data: [DONE]\n\n",
                ]
                .concat();
                sock.write_all(&[sse.as_bytes(), &chunk(&body), b"0\r\n\r\n"].concat())
                    .await
            }
            Bad::SseBinary => {
                let body = [
                    EVENT.as_bytes(),
                    b"data: \xff\xfe\x00\x01\x80\n\n",
                    b"data: [DONE]\n\n",
                ]
                .concat();
                sock.write_all(
                    &[sse.as_bytes(), &chunk(EVENT.as_bytes()), &chunk(&body[EVENT.len()..]), b"0\r\n\r\n"]
                        .concat(),
                )
                .await
            }
            Bad::SseShortLength => {
                sock.write_all(
                    format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100000\r\n\r\n{EVENT}")
                        .as_bytes(),
                )
                .await
            }
            Bad::Ndjson => {
                let body = b"{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"done\":false}\n{\"model\":\"m\",\"done\":true}\n{not json\n";
                sock.write_all(
                    &[head("application/x-ndjson").as_bytes(), &chunk(body), b"0\r\n\r\n"].concat(),
                )
                .await
            }
            Bad::InvalidJson => {
                sock.write_all(
                    &[json.as_bytes(), &chunk(b"{\"id\":\"x\",\"choices\":[\xff"), b"0\r\n\r\n"]
                        .concat(),
                )
                .await
            }
            Bad::EndlessBody => {
                let _ = sock.write_all(json.as_bytes()).await;
                let block = vec![b' '; 64 * 1024];
                for _ in 0..1000 {
                    if sock.write_all(&chunk(&block)).await.is_err() {
                        break;
                    }
                }
                Ok(())
            }
            Bad::TrickleBody => {
                let _ = sock.write_all(json.as_bytes()).await;
                for _ in 0..600 {
                    if sock.write_all(&chunk(b" ")).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(())
            }
            Bad::SplitGood => {
                let all = format!("{EVENT}{EVENT}{EVENT}data: [DONE]\n\n");
                let bytes = all.as_bytes();
                let cuts = [0, 7, EVENT.len() - 1, EVENT.len() + 1, 2 * EVENT.len() + 30, bytes.len() - 3, bytes.len()];
                let _ = sock.write_all(sse.as_bytes()).await;
                for w in cuts.windows(2) {
                    if sock.write_all(&chunk(&bytes[w[0]..w[1]])).await.is_err() {
                        break;
                    }
                    let _ = sock.flush().await;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                sock.write_all(b"0\r\n\r\n").await
            }
            Bad::ShortLength => {
                sock.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{}",
                        " ".repeat(100)
                    )
                    .as_bytes(),
                )
                .await
            }
        };
        return;
    }
}

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
        let resp = client()
            .post(g.url("/v1/chat/completions"))
            .json(&chat_body("ok", false, 3))
            .send()
            .await
            .unwrap();
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
    let resp = client()
        .post(g.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
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
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{how:?} took {:?}",
            started.elapsed()
        );
        assert!(
            failures(&g, "bad") >= 1,
            "{how:?}: passive health saw nothing"
        );
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
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{how:?} took {:?}",
            started.elapsed()
        );
        assert!(
            failures(&g, "bad") >= 1,
            "{how:?}: passive health saw nothing"
        );
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
    let g = TestGateway::start_healthy(&format!(
        "[routing]\npolicy = \"round-robin\"\n[health]\ninterval = \"50ms\"\ntimeout = \"500ms\"\nhealthy_threshold = 1\nunhealthy_threshold = 1\neject_after_failures = 2\nbase_ejection = \"30s\"\n{}{}",
        backend("bad", "openai", &url, &["m"]),
        backend("good", "vllm", &good.url(), &["m"])
    ))
    .await;
    for _ in 0..6 {
        let resp = client()
            .post(g.url("/v1/chat/completions"))
            .json(&chat_body("m", false, 3))
            .send()
            .await
            .unwrap();
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
    let g = TestGateway::start_healthy(&format!(
        "{FAST_HEALTH}{}",
        backend("b", "openai", &b.url(), &["m"])
    ))
    .await;
    let (status, _, body) = request(&g, true).await;
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.len(), 3, "{body}");
    assert_eq!(data[2], "[DONE]");
    assert!(!body.contains("backend_stream_interrupted"), "{body}");
    g.stop().await;
}
