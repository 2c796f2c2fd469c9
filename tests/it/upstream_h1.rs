//! The plain-http upstream client (`sluice::upstream::h1`) against raw backends that write
//! exact bytes: framing (length, chunked, both, overflow), 1xx heads, bodiless answers,
//! connection reuse only after a body read to its end, a backend closing an idle connection,
//! a request lost on a reused connection (never written twice), trailers, header limits and
//! invalid header bytes. The last tests go through the gateway: what the client rejects is a
//! clean 502 and what it accepts is forwarded unchanged.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::BodyExt;
use sluice::upstream::h1::{self, Error, ParseError, Pool, Settings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::*;

/// What a scripted backend does with request `n` (0-based) of connection `c`.
#[derive(Clone)]
enum Reply {
    /// Write these bytes and keep reading requests.
    Write(Vec<u8>),
    /// Write these bytes, then close the connection.
    WriteClose(Vec<u8>),
    /// Close without answering (the request was read).
    Close,
}

/// (connection index, request line, body) of each request a backend read.
type Seen = Arc<Mutex<Vec<(usize, String, Vec<u8>)>>>;

/// The answer to request `n` of connection `c`, by position or also by request line.
#[derive(Clone, Copy)]
enum Script {
    Position(fn(usize, usize) -> Reply),
    Line(fn(usize, usize, &str) -> Reply),
}

impl Script {
    fn reply(self, c: usize, n: usize, line: &str) -> Reply {
        match self {
            Script::Position(f) => f(c, n),
            Script::Line(f) => f(c, n, line),
        }
    }
}

/// A raw backend answering from a script; it records every request it read.
struct Scripted {
    url: String,
    /// (connection index, request line, body) of each request read.
    seen: Seen,
    /// Connections the backend closed.
    closed: Arc<AtomicUsize>,
}

impl Scripted {
    async fn start(script: fn(usize, usize) -> Reply) -> Scripted {
        Scripted::spawn(Script::Position(script)).await
    }

    async fn start_with(script: fn(usize, usize, &str) -> Reply) -> Scripted {
        Scripted::spawn(Script::Line(script)).await
    }

    async fn spawn(script: Script) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let closed = Arc::new(AtomicUsize::new(0));
        let (s, cl) = (seen.clone(), closed.clone());
        tokio::spawn(async move {
            for c in 0.. {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(serve(sock, c, script, s.clone(), cl.clone()));
            }
        });
        Scripted { url, seen, closed }
    }

    fn requests(&self) -> Vec<(usize, String, Vec<u8>)> {
        self.seen.lock().unwrap().clone()
    }

    fn connections(&self) -> usize {
        self.requests()
            .iter()
            .map(|(c, _, _)| c + 1)
            .max()
            .unwrap_or(0)
    }
}

async fn serve(
    mut sock: TcpStream,
    c: usize,
    script: Script,
    seen: Seen,
    closed: Arc<AtomicUsize>,
) {
    for n in 0.. {
        let Some((line, body)) = read_request(&mut sock).await else {
            break;
        };
        let reply = script.reply(c, n, &line);
        seen.lock().unwrap().push((c, line, body));
        match reply {
            Reply::Write(b) => {
                if sock.write_all(&b).await.is_err() {
                    break;
                }
            }
            Reply::WriteClose(b) => {
                let _ = sock.write_all(&b).await;
                break;
            }
            Reply::Close => break,
        }
    }
    let _ = sock.shutdown().await;
    drop(sock);
    closed.fetch_add(1, Ordering::SeqCst);
}

/// One request: its request line and its body (by Content-Length).
async fn read_request(sock: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = sock.read(&mut tmp).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&tmp[..n]);
            }
            let line = head.lines().next().unwrap_or("").to_string();
            return Some((line, buf[end + 4..end + 4 + len].to_vec()));
        }
        let n = sock.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

fn pool() -> Arc<Pool> {
    Arc::new(Pool::new(Settings {
        connect_timeout: Duration::from_secs(2),
        tcp_keepalive: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(60),
        max_idle: 16,
    }))
}

fn request(b: &Scripted, method: Method, body: &'static str) -> Request<Bytes> {
    Request::builder()
        .method(method)
        .uri(format!("{}/v1/chat/completions", b.url))
        .header("x-request-id", "t-1")
        .body(Bytes::from_static(body.as_bytes()))
        .unwrap()
}

/// Send, then read the whole body.
async fn call(p: &Arc<Pool>, req: Request<Bytes>) -> Result<(u16, Vec<u8>), Error> {
    let resp = h1::send(p, req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body.to_vec()))
}

fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test]
async fn length_and_chunked_bodies_reuse_one_connection() {
    let b = Scripted::start(|_, n| match n {
        0 => Reply::Write(ok("first")),
        _ => Reply::Write(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nsec\r\n3;x=y\r\nond\r\n0\r\nx-trailer: 1\r\n\r\n"
                .to_vec(),
        ),
    })
    .await;
    let p = pool();
    let r1 = call(&p, request(&b, Method::POST, "{\"a\":1}"))
        .await
        .unwrap();
    assert_eq!(r1, (200, b"first".to_vec()));
    assert_eq!(p.idle_count(), 1, "read to its end: back in the pool");
    let r2 = call(&p, request(&b, Method::POST, "{}")).await.unwrap();
    assert_eq!(r2, (200, b"second".to_vec()), "trailers dropped");
    for _ in 0..3 {
        call(&p, request(&b, Method::POST, "{}")).await.unwrap();
    }
    let seen = b.requests();
    assert_eq!(seen.len(), 5);
    assert_eq!(b.connections(), 1, "one connection for every request");
    assert_eq!(seen[0].1, "POST /v1/chat/completions HTTP/1.1");
    assert_eq!(seen[0].2, b"{\"a\":1}");
}

#[tokio::test]
async fn length_and_chunked_together_are_rejected_and_the_connection_closed() {
    let b = Scripted::start(|c, _| match c {
        0 => Reply::Write(
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        ),
        _ => Reply::Write(ok("fine")),
    })
    .await;
    let p = pool();
    let e = call(&p, request(&b, Method::POST, "{}")).await.unwrap_err();
    assert!(
        matches!(e, Error::Parse(ParseError::LengthAndChunked)),
        "{e}"
    );
    assert_eq!(p.idle_count(), 0);
    assert_eq!(
        call(&p, request(&b, Method::POST, "{}")).await.unwrap().1,
        b"fine"
    );
    assert_eq!(b.connections(), 2);
}

#[tokio::test]
async fn framing_errors_in_the_head_and_the_body() {
    let b = Scripted::start(|c, _| {
        Reply::WriteClose(match c {
            0 => b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffffffff\r\nx"
                .to_vec(),
            1 => b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nhello".to_vec(),
            2 => b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhelloXY".to_vec(),
            3 => b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort".to_vec(),
            4 => b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n".to_vec(),
            5 => b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n".to_vec(),
            _ => b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\r\n\r\n".to_vec(),
        })
    })
    .await;
    let p = pool();
    let mut errors = Vec::new();
    for _ in 0..7 {
        let e = call(&p, request(&b, Method::POST, "{}")).await.unwrap_err();
        errors.push(e.to_string());
        assert_eq!(p.idle_count(), 0);
    }
    assert!(errors[0].contains("overflow"), "{errors:?}");
    assert!(errors[1].contains("Content-Length"), "{errors:?}");
    assert!(errors[2].contains("CRLF"), "{errors:?}");
    assert!(errors[3].contains("closed before"), "{errors:?}");
    assert!(errors[4].contains("closed before"), "{errors:?}");
    assert!(errors[5].contains("101"), "{errors:?}");
    assert!(errors[6].contains("invalid response head"), "{errors:?}");
}

#[tokio::test]
async fn informational_heads_are_skipped() {
    let b = Scripted::start(|_, _| {
        Reply::Write(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-final: yes\r\n\r\nok"
                .to_vec(),
        )
    })
    .await;
    let p = pool();
    let resp = h1::send(&p, request(&b, Method::POST, "{}")).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-final"], "yes");
    assert!(
        resp.headers().get("link").is_none(),
        "the 103's fields stay out"
    );
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
    assert_eq!(
        call(&p, request(&b, Method::POST, "{}")).await.unwrap().1,
        b"ok"
    );
    assert_eq!(b.connections(), 1);
}

#[tokio::test]
async fn bodiless_answers_keep_the_connection_in_step() {
    // 204 and 304 with a Content-Length, and a HEAD answer with one: none has a body, so the
    // next answer on the connection is read from the right byte.
    let b = Scripted::start(|_, n| {
        Reply::Write(match n {
            0 => b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n".to_vec(),
            1 => b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n".to_vec(),
            2 => b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n".to_vec(),
            _ => ok("after"),
        })
    })
    .await;
    let p = pool();
    assert_eq!(
        call(&p, request(&b, Method::POST, "{}")).await.unwrap(),
        (204, vec![])
    );
    assert_eq!(
        call(&p, request(&b, Method::GET, "")).await.unwrap(),
        (304, vec![])
    );
    assert_eq!(
        call(&p, request(&b, Method::HEAD, "")).await.unwrap(),
        (200, vec![])
    );
    assert_eq!(
        call(&p, request(&b, Method::GET, "")).await.unwrap(),
        (200, b"after".to_vec())
    );
    assert_eq!(b.connections(), 1);
    assert_eq!(b.requests()[3].1, "GET /v1/chat/completions HTTP/1.1");
}

#[tokio::test]
async fn a_connection_is_reused_only_after_its_body_was_read_to_the_end() {
    let b = Scripted::start(|_, _| Reply::Write(ok("0123456789"))).await;
    let p = pool();
    let resp = h1::send(&p, request(&b, Method::POST, "{}")).await.unwrap();
    drop(resp); // body never read
    assert_eq!(p.idle_count(), 0);
    let mut body = h1::send(&p, request(&b, Method::POST, "{}"))
        .await
        .unwrap()
        .into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(!first.is_empty());
    if first.len() < 10 {
        drop(body); // part of it read: still not reusable
        assert_eq!(p.idle_count(), 0);
    } else {
        assert_eq!(p.idle_count(), 1, "the whole body came in one frame");
        drop(body);
    }
    call(&p, request(&b, Method::POST, "{}")).await.unwrap();
    call(&p, request(&b, Method::POST, "{}")).await.unwrap();
    let conns = b.connections();
    assert!((2..=3).contains(&conns), "{conns}");
    // Bytes after the end of a body: the connection is closed, not reused.
    let extra =
        Scripted::start(|_, _| Reply::Write([ok("x"), b"HTTP/1.1 200 OK\r\n".to_vec()].concat()))
            .await;
    call(&p, request(&extra, Method::POST, "{}")).await.unwrap();
    call(&p, request(&extra, Method::POST, "{}")).await.unwrap();
    assert_eq!(extra.connections(), 2);
}

#[tokio::test]
async fn connection_close_and_close_delimited_answers_are_not_reused() {
    let b = Scripted::start(|_, n| match n {
        0 => Reply::WriteClose(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end".to_vec(),
        ),
        _ => unreachable!("one request per connection"),
    })
    .await;
    let p = pool();
    assert_eq!(
        call(&p, request(&b, Method::POST, "{}")).await.unwrap().1,
        b"until the end"
    );
    assert_eq!(
        call(&p, request(&b, Method::POST, "{}")).await.unwrap().1,
        b"until the end"
    );
    assert_eq!(b.connections(), 2);
    let c = Scripted::start(|_, _| {
        Reply::Write(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok".to_vec(),
        )
    })
    .await;
    call(&p, request(&c, Method::POST, "{}")).await.unwrap();
    assert_eq!(p.idle_count(), 0);
}

#[tokio::test]
async fn an_idle_connection_the_backend_closed_is_replaced_and_the_request_sent_once() {
    // The backend answers (keep-alive) and then closes the connection, as an engine's idle
    // timeout does between requests.
    let b = Scripted::start(|_, _| Reply::WriteClose(ok("hi"))).await;
    let p = pool();
    call(&p, request(&b, Method::POST, "{\"n\":1}"))
        .await
        .unwrap();
    assert_eq!(p.idle_count(), 1);
    eventually(Duration::from_secs(5), "the backend closed", || async {
        b.closed.load(Ordering::SeqCst) == 1
    })
    .await;
    let r = call(&p, request(&b, Method::POST, "{\"n\":2}"))
        .await
        .unwrap();
    assert_eq!(r, (200, b"hi".to_vec()));
    let seen = b.requests();
    assert_eq!(seen.len(), 2, "each request sent once: {seen:?}");
    assert_eq!(
        (seen[0].0, seen[1].0),
        (0, 1),
        "the second on a new connection"
    );
}

#[tokio::test]
async fn a_request_lost_on_a_reused_connection_is_not_written_twice() {
    // The backend reads the second request on the kept-alive connection and closes without a
    // byte of answer: it may have received it, so this client does not send it again (the
    // proxy's failover decides what happens next).
    let b = Scripted::start(|_, n| match n {
        0 => Reply::Write(ok("hi")),
        _ => Reply::Close,
    })
    .await;
    let p = pool();
    call(&p, request(&b, Method::POST, "{\"n\":1}"))
        .await
        .unwrap();
    let e = call(&p, request(&b, Method::POST, "{\"n\":2}"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Closed | Error::Io(_)), "{e}");
    assert!(!e.is_connect());
    let seen = b.requests();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(b.connections(), 1);
}

#[tokio::test]
async fn header_limits_and_invalid_header_bytes() {
    let b = Scripted::start(|c, _| {
        Reply::WriteClose(match c {
            0 => {
                let fields: String = (0..101).map(|i| format!("x-{i}: v\r\n")).collect();
                format!("HTTP/1.1 200 OK\r\n{fields}content-length: 0\r\n\r\n").into_bytes()
            }
            1 => format!("HTTP/1.1 200 OK\r\nx-big: {}\r\n", "a".repeat(70 * 1024)).into_bytes(),
            2 => b"HTTP/1.1 200 OK\r\nx-bad: a\x00b\r\ncontent-length: 0\r\n\r\n".to_vec(),
            3 => b"HTTP/1.1 200 OK\r\nx bad: a\r\ncontent-length: 0\r\n\r\n".to_vec(),
            4 => b"HTTP/1.1 200 OK\r\nx-fold: a\r\n b\r\ncontent-length: 0\r\n\r\n".to_vec(),
            _ => b"HTTP/1.1 200 OK\r\nx-obs: caf\xc3\xa9\r\ncontent-length: 0\r\n\r\n".to_vec(),
        })
    })
    .await;
    let p = pool();
    let mut out = Vec::new();
    for _ in 0..6 {
        out.push(
            h1::send(&p, request(&b, Method::POST, "{}"))
                .await
                .map(|r| r.status()),
        );
    }
    let msg = |i: usize| out[i].as_ref().unwrap_err().to_string();
    assert!(msg(0).contains("more than 100"), "{out:?}");
    assert!(msg(1).contains("larger than"), "{out:?}");
    assert!(msg(2).contains("invalid header"), "{out:?}");
    assert!(msg(3).contains("invalid header"), "{out:?}");
    assert!(out[4].is_err(), "obsolete line folding is refused: {out:?}");
    assert_eq!(
        out[5].as_ref().unwrap(),
        &200,
        "obs-text in a value is allowed"
    );
}

#[tokio::test]
async fn a_backend_that_is_not_listening_is_a_connect_error() {
    let port = free_port();
    let p = pool();
    let req = Request::post(format!("http://127.0.0.1:{port}/v1/x"))
        .body(Bytes::new())
        .unwrap();
    let e = h1::send(&p, req).await.unwrap_err();
    assert!(e.is_connect(), "{e}");
}

/// Proxied POSTs the gateway test's backend has answered (probes are GETs).
static GATEWAY_POSTS: AtomicUsize = AtomicUsize::new(0);

#[tokio::test]
async fn the_gateway_answers_502_for_what_the_client_rejects_and_forwards_the_rest() {
    let b = Scripted::start_with(|_, _, line| {
        if line.starts_with("GET") {
            return Reply::Write(ok(r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#));
        }
        if GATEWAY_POSTS.fetch_add(1, Ordering::SeqCst) == 0 {
            return Reply::Write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                    .to_vec(),
            );
        }
        let body = r#"{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
        Reply::Write(
            format!(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\nx-t: 1\r\n\r\n",
                body.len()
            )
            .into_bytes(),
        )
    })
    .await;
    let g = TestGateway::start(&format!(
        "[routing]\nmax_attempts = 1\n{}",
        backend("raw", "openai", &b.url, &["m"])
    ))
    .await;
    let first = g.chat(&chat_body("m", false, 5)).await;
    assert_eq!(first.status(), 502);
    let second = g.chat(&chat_body("m", false, 5)).await;
    assert_eq!(second.status(), 200);
    let v: serde_json::Value = second.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hi");
}
