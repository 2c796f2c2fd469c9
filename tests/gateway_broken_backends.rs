//! Backends that misbehave in the middle of an answer: a stream that stalls, a connection
//! closed mid-chunk, a stream that ends without finishing, an endless event, an endless header.
//! The affected client always gets a clean, OpenAI-shaped end; nothing hangs; the gateway keeps
//! serving.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    /// One event, then silence with the connection open.
    Stall,
    /// A chunk header announcing more bytes than are sent, then close.
    CloseMidChunk,
    /// Two events, then a clean end of body without `[DONE]` or a finish reason.
    EndEarly,
    /// Megabytes of bytes with no event boundary.
    EndlessEvent,
    /// Response headers that never end.
    EndlessHeader,
}

const EVENT: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n";

/// A raw HTTP/1.1 backend that answers probes properly and inference requests badly.
async fn bad_backend(how: Misbehaviour) -> String {
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
            return Some(head);
        }
    }
}

async fn serve_conn(mut sock: TcpStream, how: Misbehaviour) {
    while let Some(head) = read_request(&mut sock).await {
        if head.starts_with("GET") {
            let body = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
            let resp = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            if sock.write_all(resp.as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        let sse_head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        let chunk = |s: &str| format!("{:x}\r\n{s}\r\n", s.len());
        match how {
            Misbehaviour::Stall => {
                let _ = sock
                    .write_all(format!("{sse_head}{}", chunk(EVENT)).as_bytes())
                    .await;
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            Misbehaviour::CloseMidChunk => {
                let _ = sock
                    .write_all(format!("{sse_head}{}", chunk(EVENT)).as_bytes())
                    .await;
                let _ = sock.write_all(b"400\r\ndata: {\"id\":").await;
            }
            Misbehaviour::EndEarly => {
                let _ = sock
                    .write_all(
                        format!("{sse_head}{}{}0\r\n\r\n", chunk(EVENT), chunk(EVENT)).as_bytes(),
                    )
                    .await;
                continue;
            }
            Misbehaviour::EndlessEvent => {
                let _ = sock.write_all(sse_head.as_bytes()).await;
                let junk = "x".repeat(64 * 1024);
                for _ in 0..200 {
                    if sock.write_all(chunk(&junk).as_bytes()).await.is_err() {
                        break;
                    }
                }
            }
            Misbehaviour::EndlessHeader => {
                let _ = sock.write_all(b"HTTP/1.1 200 OK\r\n").await;
                for i in 0..100_000 {
                    if sock
                        .write_all(format!("x-junk-{i}: {}\r\n", "y".repeat(100)).as_bytes())
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        return;
    }
}

async fn gateway_for(url: &str) -> TestGateway {
    TestGateway::start_healthy(&format!(
        "[routing]\nmax_attempts = 1\n[timeouts]\nidle = \"300ms\"\nfirst_byte = \"2s\"\n{FAST_HEALTH}{}",
        backend("bad", "openai", url, &["m"])
    ))
    .await
}

/// Stream `m` through the gateway; returns the payloads received.
async fn stream(g: &TestGateway) -> (u16, Vec<String>) {
    let resp = client()
        .post(g.url("/v1/chat/completions"))
        .json(&chat_body("m", true, 20))
        .send()
        .await
        .unwrap();
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
    let resp = client()
        .post(g.url("/v1/chat/completions"))
        .json(&chat_body("m", false, 5))
        .send()
        .await
        .unwrap();
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
        let resp = client()
            .post(g.url("/v1/chat/completions"))
            .json(&chat_body("ok", false, 3))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    for s in stalled {
        let body = s.await.unwrap();
        assert_terminal_error(&sse_data(&body));
    }
    g.stop().await;
}
