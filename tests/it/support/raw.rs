//! Backends that misbehave at the byte level, which no simulator would: one raw HTTP/1.1
//! server, configured by a [`Misbehaviour`]. It answers every `GET` (health probes, model
//! lists) properly and every other request as its misbehaviour says, as a script of writes
//! and pauses.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One good chat-completion chunk event for model `m`.
pub const EVENT: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n";

/// How the backend answers an inference request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Misbehaviour {
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
    /// Two good events, then the engine's error event and `[DONE]` (an engine that failed
    /// mid-answer, as vLLM reports it).
    SseErrorEvent,
}

/// One step of an answer. A failed write ends the answer.
enum Step {
    Write(Vec<u8>),
    Pause(Duration),
    /// `times` writes of `make(i)`, each followed by `pause`.
    Each {
        times: usize,
        make: fn(usize) -> Vec<u8>,
        pause: Duration,
    },
}

/// Start the backend; returns its base URL.
pub async fn bad_backend(how: Misbehaviour) -> String {
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

async fn serve_conn(mut sock: TcpStream, how: Misbehaviour) {
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
        for step in script(how) {
            let written = match step {
                Step::Write(bytes) => sock.write_all(&bytes).await,
                Step::Pause(d) => {
                    tokio::time::sleep(d).await;
                    Ok(())
                }
                Step::Each { times, make, pause } => {
                    write_each(&mut sock, times, make, pause).await
                }
            };
            if written.is_err() {
                return;
            }
        }
        // A body that ended cleanly leaves the connection open for the next request.
        if how != Misbehaviour::EndEarly {
            return;
        }
    }
}

async fn write_each(
    sock: &mut TcpStream,
    times: usize,
    make: fn(usize) -> Vec<u8>,
    pause: Duration,
) -> std::io::Result<()> {
    for i in 0..times {
        sock.write_all(&make(i)).await?;
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
    Ok(())
}

/// A 200 response head with a chunked body of `content_type`.
fn head(content_type: &str) -> Vec<u8> {
    format!("HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n")
        .into_bytes()
}

/// `s` as one chunk of a chunked body.
fn chunk(s: &[u8]) -> Vec<u8> {
    [format!("{:x}\r\n", s.len()).as_bytes(), s, b"\r\n"].concat()
}

const SSE: &str = "text/event-stream";
const JSON: &str = "application/json";
const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// What the backend writes for an inference request.
fn script(how: Misbehaviour) -> Vec<Step> {
    use Misbehaviour as M;
    use Step::{Each, Pause, Write};
    let none = Duration::ZERO;
    let event = EVENT.as_bytes();
    match how {
        M::Stall => vec![
            Write([head(SSE), chunk(event)].concat()),
            Pause(Duration::from_secs(30)),
        ],
        M::CloseMidChunk => vec![
            Write([head(SSE), chunk(event)].concat()),
            Write(b"400\r\ndata: {\"id\":".to_vec()),
        ],
        M::SseErrorEvent => vec![Write(
            [
                head(SSE),
                chunk(event),
                chunk(event),
                chunk(b"data: {\"error\":{\"message\":\"EngineCore encountered an issue.\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\n"),
                chunk(b"data: [DONE]\n\n"),
                LAST_CHUNK.to_vec(),
            ]
            .concat(),
        )],
        M::EndEarly => vec![Write(
            [head(SSE), chunk(event), chunk(event), LAST_CHUNK.to_vec()].concat(),
        )],
        M::EndlessEvent => vec![
            Write(head(SSE)),
            Each {
                times: 200,
                make: |_| chunk(&[b'x'; 64 * 1024]),
                pause: none,
            },
        ],
        M::EndlessHeader => vec![
            Write(b"HTTP/1.1 200 OK\r\n".to_vec()),
            Each {
                times: 100_000,
                make: |i| format!("x-junk-{i}: {}\r\n", "y".repeat(100)).into_bytes(),
                pause: none,
            },
        ],
        M::Garbage => vec![Write(
            b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe garbage \x01\x02\r\n\r\n".to_vec(),
        )],
        M::OverflowChunkSize => vec![Write(
            [head(JSON), b"fffffffffffffffffffffffff\r\n{}".to_vec()].concat(),
        )],
        M::GiantChunkJson => vec![
            Write([head(JSON), b"4000000\r\n".to_vec()].concat()),
            Each {
                times: 64,
                make: |_| vec![b' '; 64 * 1024],
                pause: none,
            },
        ],
        M::GiantChunkSse => vec![
            Write([head(SSE), format!("4000000\r\n{EVENT}data: ").into_bytes()].concat()),
            Each {
                times: 10 * 16,
                make: |_| vec![b'x'; 64 * 1024],
                pause: none,
            },
        ],
        M::EndlessBody => vec![
            Write(head(JSON)),
            Each {
                times: 1000,
                make: |_| chunk(&[b' '; 64 * 1024]),
                pause: none,
            },
        ],
        M::TrickleBody => vec![
            Write(head(JSON)),
            Each {
                times: 600,
                make: |_| chunk(b" "),
                pause: Duration::from_millis(50),
            },
        ],
        M::SplitGood => split_good(),
        whole => vec![Write(whole_answer(whole))],
    }
}

/// The answers written in one go.
fn whole_answer(how: Misbehaviour) -> Vec<u8> {
    use Misbehaviour as M;
    let event = EVENT.as_bytes();
    let body = |content_type: &str, body: &[u8]| {
        [head(content_type), chunk(body), LAST_CHUNK.to_vec()].concat()
    };
    match how {
        M::SseNoData => body(SSE, b"hello\nworld: 1\n\nevent: ping\n\nretry: 10\n\n"),
        M::SseInvalidJson => body(
            SSE,
            &[
                event,
                b"data: {\"choices\":[{\"delta\":{\"content\":\"oops\"\n\n",
                event,
                b"data: [DONE]\n\n",
            ]
            .concat(),
        ),
        M::SseBinary => [
            head(SSE),
            chunk(event),
            chunk(b"data: \xff\xfe\x00\x01\x80\n\ndata: [DONE]\n\n"),
            LAST_CHUNK.to_vec(),
        ]
        .concat(),
        M::SseShortLength => format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 100000\r\n\r\n{EVENT}"
        )
        .into_bytes(),
        M::Ndjson => body(
            "application/x-ndjson",
            b"{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"done\":false}\n{\"model\":\"m\",\"done\":true}\n{not json\n",
        ),
        M::InvalidJson => body(JSON, b"{\"id\":\"x\",\"choices\":[\xff"),
        M::ShortLength => format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{}",
            " ".repeat(100)
        )
        .into_bytes(),
        other => unreachable!("{other:?} is not written in one go"),
    }
}

/// Three good events and `[DONE]`, cut into chunks at odd places, sent 20 ms apart.
fn split_good() -> Vec<Step> {
    let all = format!("{EVENT}{EVENT}{EVENT}data: [DONE]\n\n");
    let bytes = all.as_bytes();
    let n = EVENT.len();
    let cuts = [0, 7, n - 1, n + 1, 2 * n + 30, bytes.len() - 3, bytes.len()];
    let mut steps = vec![Step::Write(head(SSE))];
    for w in cuts.windows(2) {
        steps.push(Step::Write(chunk(&bytes[w[0]..w[1]])));
        steps.push(Step::Pause(Duration::from_millis(20)));
    }
    steps.push(Step::Write(LAST_CHUNK.to_vec()));
    steps
}
