//! Resource bounds on the client side, on real sockets: connection caps per listener and per
//! client address (and who is exempt from the latter: loopback, trusted proxies), slowloris on heads and bodies, idle keep-alive connections, header count and
//! size, and HTTP/2 rapid reset. Timeouts are configured short so the file runs in seconds;
//! every wait is a poll or a read with a deadline.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::{metric, poll, TestGateway};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// How a connection's read side ended.
#[derive(Debug, PartialEq)]
enum End {
    /// The peer closed (EOF or reset) after sending these bytes.
    Closed(String),
    /// Still open when the deadline passed, with what arrived so far.
    Open(String),
}

/// Read until the peer closes or `within` passes.
async fn read_to_end(s: &mut TcpStream, within: Duration) -> End {
    let deadline = tokio::time::Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return End::Open(String::from_utf8_lossy(&got).into_owned()),
            Ok(Ok(0)) | Ok(Err(_)) => {
                return End::Closed(String::from_utf8_lossy(&got).into_owned())
            }
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Read one HTTP/1.1 response (head + content-length body) within `within`.
async fn read_response(s: &mut TcpStream, within: Duration) -> Option<String> {
    let deadline = tokio::time::Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let len = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                return Some(text);
            }
        }
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => return None,
        }
    }
}

/// A TCP connection from `from` (any 127/8 address works on Linux loopback).
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
    sock.connect(to).await.unwrap()
}

/// Send `GET /healthz` on a kept-alive connection; whether it was answered 200.
async fn healthz(s: &mut TcpStream) -> bool {
    if s.write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    read_response(s, Duration::from_secs(5))
        .await
        .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
}

/// An admitted, served connection from `from`.
async fn served(from: &str, to: SocketAddr) -> TcpStream {
    let mut s = connect_from(from, to).await;
    assert!(healthz(&mut s).await, "connection from {from} not served");
    s
}

/// A connection from `from` is refused: closed at once, with at most a 503.
async fn assert_refused(from: &str, to: SocketAddr) {
    let mut s = connect_from(from, to).await;
    let _ = s
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        .await;
    match read_to_end(&mut s, Duration::from_secs(5)).await {
        End::Closed(text) => assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 503"),
            "refused connection got: {text}"
        ),
        End::Open(text) => panic!("connection from {from} was not refused: {text}"),
    }
}

/// A new connection from `from` is admitted again within a deadline (slots free on close).
async fn admitted_again(from: &str, to: SocketAddr) -> TcpStream {
    poll(
        Duration::from_secs(5),
        format!("a slot freed for {from}"),
        || async {
            let mut s = connect_from(from, to).await;
            healthz(&mut s).await.then_some(s)
        },
    )
    .await
}

/// Loopback is exempt from the per-address cap by default; these tests cap it explicitly.
const CAP_LOOPBACK: &str = "per_ip_exempt_loopback = false\n";

#[tokio::test]
async fn per_ip_cap_refuses_the_next_connection_and_frees_on_close() {
    let g = TestGateway::start(&format!(
        "[server]\nmax_connections = 100\nmax_connections_per_ip = 3\n{CAP_LOOPBACK}"
    ))
    .await;
    let (_, before) = rejected_per_ip(&g).await;
    let mut first = Vec::new();
    for _ in 0..3 {
        first.push(served("127.0.0.1", g.addr).await);
    }
    assert_refused("127.0.0.1", g.addr).await;
    // Another address is not affected by the first one's cap.
    let mut other = served("127.0.0.2", g.addr).await;
    for s in &mut first {
        assert!(healthz(s).await, "an admitted connection stopped working");
    }
    assert!(healthz(&mut other).await);
    drop(first.pop());
    let _again = admitted_again("127.0.0.1", g.addr).await;
    assert_refused("127.0.0.1", g.addr).await;

    // From another address: 127.0.0.1 is at its cap.
    let (text, rejected) = rejected_per_ip(&g).await;
    assert!(rejected - before >= 2.0, "{text}");
}

/// Connections held open from 127.0.0.1 for the loopback test: well over the default
/// `max_connections_per_ip` (1000), well under `max_connections` (10 000). Both ends live in
/// this process: 2 descriptors each.
const HELD_FROM_LOOPBACK: usize = 2500;

/// A connection from `from` that has been served one request and is kept alive.
async fn served_quietly(from: &str, to: SocketAddr) -> Option<TcpStream> {
    let sock = TcpSocket::new_v4().ok()?;
    sock.bind(format!("{from}:0").parse().ok()?).ok()?;
    let mut s = sock.connect(to).await.ok()?;
    healthz(&mut s).await.then_some(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_is_not_capped_per_address_by_default() {
    use futures_util::StreamExt;
    let s = support::sim(sluice::sim::SimKind::Vllm, &["m"]).await;
    // The default per-address settings; the waits for the next request on a kept-alive
    // connection are made long so every held connection is still open at the end, however
    // slowly the machine opens them.
    let g = TestGateway::start_healthy(&format!(
        "[server]\nheader_read_timeout = \"300s\"\nidle_timeout = \"300s\"\n{}{}",
        support::FAST_HEALTH,
        support::backend("b", "vllm", &s.url(), &["m"])
    ))
    .await;
    let held: Vec<Option<TcpStream>> = futures_util::stream::iter(0..HELD_FROM_LOOPBACK)
        .map(|_| served_quietly("127.0.0.1", g.addr))
        .buffer_unordered(64)
        .collect()
        .await;
    let mut held: Vec<TcpStream> = held.into_iter().flatten().collect();
    assert_eq!(
        held.len(),
        HELD_FROM_LOOPBACK,
        "connections from 127.0.0.1 refused"
    );

    // The next ordinary request from the same address, on a new connection.
    let c = reqwest::Client::builder()
        .local_address("127.0.0.1".parse::<std::net::IpAddr>().unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let r = c
        .post(g.url("/v1/chat/completions"))
        .json(&support::chat_body("m", false, 5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("\"choices\""));

    // Every held connection was open all along and still serves.
    let mut alive = 0;
    for s in &mut held {
        alive += usize::from(healthz(s).await);
    }
    assert_eq!(
        alive, HELD_FROM_LOOPBACK,
        "held connections closed meanwhile"
    );
}

#[tokio::test]
async fn trusted_proxies_are_exempt_from_the_per_ip_cap_and_others_are_not() {
    let g = TestGateway::start(&format!(
        "[server]\nmax_connections = 100\nmax_connections_per_ip = 2\n{CAP_LOOPBACK}trusted_proxies = [\"127.0.0.7/32\"]\n"
    ))
    .await;
    let mut proxy = Vec::new();
    for _ in 0..6 {
        proxy.push(served("127.0.0.7", g.addr).await);
    }
    let _a = served("127.0.0.1", g.addr).await;
    let _b = served("127.0.0.1", g.addr).await;
    assert_refused("127.0.0.1", g.addr).await;
    for s in &mut proxy {
        assert!(
            healthz(s).await,
            "a connection from the trusted proxy stopped working"
        );
    }
}

/// `/metrics` (read from 127.0.0.9, which has no connection yet) and its count of connections
/// refused for the per-address cap. The counter is process-wide: tests compare two readings.
async fn rejected_per_ip(g: &TestGateway) -> (String, f64) {
    let text = reqwest::Client::builder()
        .local_address("127.0.0.9".parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap()
        .get(g.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let n = metric(
        &text,
        "sluice_connections_rejected_total{listener=\"client\",reason=\"max_connections_per_ip\"}",
    );
    (text, n)
}

#[tokio::test]
async fn listener_cap_refuses_the_next_connection_and_the_admin_listener_has_its_own() {
    let g = TestGateway::start(
        "[server]\nmax_connections = 3\nmax_connections_per_ip = 0\n[admin]\nlisten = \"127.0.0.1:0\"\nmax_connections = 2\n",
    )
    .await;
    let admin = g.admin_addr.unwrap();
    let mut first = vec![
        served("127.0.0.1", g.addr).await,
        served("127.0.0.2", g.addr).await,
        served("127.0.0.3", g.addr).await,
    ];
    assert_refused("127.0.0.4", g.addr).await;
    // The admin listener counts separately, with its own smaller cap.
    let _a1 = served("127.0.0.1", admin).await;
    let _a2 = served("127.0.0.1", admin).await;
    assert_refused("127.0.0.1", admin).await;
    for s in &mut first {
        assert!(healthz(s).await);
    }
    drop(first.remove(0));
    let _again = admitted_again("127.0.0.4", g.addr).await;
    assert_refused("127.0.0.5", g.addr).await;
}

#[tokio::test]
async fn slowloris_on_the_head_is_cut_while_others_are_served() {
    let g = TestGateway::start("[server]\nheader_read_timeout = \"1s\"\n").await;
    let started = Instant::now();
    let mut slow = TcpStream::connect(g.addr).await.unwrap();
    let head =
        b"GET /healthz HTTP/1.1\r\nhost: t\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let trickle = tokio::spawn(async move {
        let mut closed_after = None;
        for &b in head.iter() {
            if slow.write_all(&[b]).await.is_err() {
                closed_after = Some(started.elapsed());
                break;
            }
            // The client's pace (one byte per 200 ms), not synchronisation.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut probe = [0u8; 256];
            match tokio::time::timeout(Duration::from_millis(1), slow.read(&mut probe)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed_after = Some(started.elapsed());
                    break;
                }
                _ => {}
            }
        }
        closed_after
    });
    // Meanwhile a normal client is served.
    let c = support::client();
    for _ in 0..5 {
        let r = c.get(g.url("/healthz")).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let closed_after = trickle
        .await
        .unwrap()
        .expect("the trickling client was never cut");
    assert!(
        closed_after < Duration::from_millis(2500),
        "cut only after {closed_after:?}"
    );
    assert!(
        closed_after >= Duration::from_millis(900),
        "cut too early: {closed_after:?}"
    );

    // A client that connects and sends nothing is cut on the same deadline (before hyper
    // even knows whether it speaks HTTP/1 or HTTP/2), as is a stalled HTTP/2 preface.
    for opening in [&b""[..], &b"PRI * HTTP/2.0\r\n"[..]] {
        let t = Instant::now();
        let mut s = TcpStream::connect(g.addr).await.unwrap();
        s.write_all(opening).await.unwrap();
        assert!(matches!(
            read_to_end(&mut s, Duration::from_secs(5)).await,
            End::Closed(_)
        ));
        assert!(
            t.elapsed() < Duration::from_millis(3500),
            "{:?}",
            t.elapsed()
        );
    }
}

#[tokio::test]
async fn trickled_body_gets_408_and_the_connection_closes() {
    let g = TestGateway::start("[server]\nbody_read_timeout = \"1s\"\n").await;
    let mut s = TcpStream::connect(g.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 400\r\nx-request-id: slow-body-1\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let started = Instant::now();
    let (mut rd, mut wr) = s.into_split();
    let trickle = tokio::spawn(async move {
        for _ in 0..40 {
            if wr.write_all(b" ").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, rd.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    let elapsed = started.elapsed();
    trickle.abort();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"code\":\"request_timeout\""), "{text}");
    assert!(
        text.contains("\"type\":\"invalid_request_error\""),
        "{text}"
    );
    assert!(
        text.to_ascii_lowercase()
            .contains("x-request-id: slow-body-1"),
        "{text}"
    );
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");

    // A body that arrives in time is not affected.
    let r = g.chat(&support::chat_body("m", false, 5)).await;
    assert_ne!(r.status(), 408);
}

#[tokio::test]
async fn idle_keepalive_connections_are_closed_after_the_idle_timeout() {
    let g = TestGateway::start("[server]\nidle_timeout = \"1s\"\nheader_read_timeout = \"10s\"\n")
        .await;
    // HTTP/1.1: served, then silent.
    let mut s = served("127.0.0.1", g.addr).await;
    let t = Instant::now();
    assert!(matches!(
        read_to_end(&mut s, Duration::from_secs(5)).await,
        End::Closed(_)
    ));
    let idle = t.elapsed();
    assert!(
        idle >= Duration::from_millis(900) && idle < Duration::from_secs(3),
        "HTTP/1 idle close after {idle:?}"
    );

    // HTTP/2: one request, then silence; the gateway sends GOAWAY and the connection ends.
    let tcp = TcpStream::connect(g.addr).await.unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn_task = tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/healthz", g.addr))
        .body(())
        .unwrap();
    let (resp, _) = client.send_request(req, true).unwrap();
    assert_eq!(resp.await.unwrap().status(), 200);
    let t = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(5), conn_task).await;
    assert!(ended.is_ok(), "HTTP/2 connection not closed while idle");
    let idle = t.elapsed();
    assert!(
        idle >= Duration::from_millis(900) && idle < Duration::from_secs(4),
        "HTTP/2 idle close after {idle:?}"
    );
}

#[tokio::test]
async fn too_many_or_too_large_headers_get_431() {
    let g = TestGateway::start("[server]\nmax_headers = 20\nmax_header_bytes = 8192\n").await;
    let c = support::client();
    let mut many = c.get(g.url("/healthz"));
    for i in 0..30 {
        many = many.header(format!("x-h{i}"), "v");
    }
    assert_eq!(many.send().await.unwrap().status(), 431);
    let big = c
        .get(g.url("/healthz"))
        .header("x-big", "a".repeat(10_000))
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 431);
    let fine = c
        .get(g.url("/healthz"))
        .header("x-ok", "a".repeat(4_000))
        .send()
        .await
        .unwrap();
    assert_eq!(fine.status(), 200);
}

/// Open `n` streams whose bodies never finish (so each reaches the gateway and waits) and
/// reset each at once. Returns whether the connection ended (GOAWAY) within `within`.
async fn reset_flood(addr: SocketAddr, n: usize, within: Duration) -> bool {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let mut conn_task = tokio::spawn(conn);
    let mut client = client;
    for _ in 0..n {
        let ready = tokio::select! {
            r = client.clone().ready() => r,
            _ = &mut conn_task => return true,
        };
        let Ok(mut c) = ready else { return true };
        let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(())
            .unwrap();
        let Ok((_resp, mut body)) = c.send_request(req, false) else {
            return true;
        };
        let _ = body.send_data(bytes::Bytes::from_static(b"{\"model\":"), false);
        // Let the gateway see the stream before it is reset (it is then counted as a
        // request the client cancelled, not only as a pending-accept reset).
        tokio::task::yield_now().await;
        body.send_reset(h2::Reason::CANCEL);
        client = c;
    }
    tokio::time::timeout(within, conn_task).await.is_ok()
}

#[tokio::test]
async fn http2_rapid_reset_gets_goaway_and_others_are_served() {
    // h2's own cap on streams reset before they were accepted is lifted here, so only the
    // gateway's count of cancelled requests can end the connection.
    let g = TestGateway::start(
        "[server]\nhttp2_max_client_resets = 50\nhttp2_max_pending_accept_reset_streams = 100000\n",
    )
    .await;
    // The counter is process-wide: this test's floods are counted from its first reading.
    let floods = |text: &str| metric(text, "sluice_http2_reset_floods_total{listener=\"client\"}");
    let before = floods(&g.metrics_text().await);
    // A few cancellations are normal use: the connection stays.
    assert!(
        !reset_flood(g.addr, 10, Duration::from_millis(500)).await,
        "10 resets closed the connection"
    );
    // A flood is not.
    assert!(
        reset_flood(g.addr, 2000, Duration::from_secs(5)).await,
        "the connection survived a reset flood"
    );
    // Others are still served, over HTTP/1 and a fresh HTTP/2 connection.
    let c = support::client();
    assert_eq!(c.get(g.url("/healthz")).send().await.unwrap().status(), 200);
    let tcp = TcpStream::connect(g.addr).await.unwrap();
    let (mut h2c, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/healthz", g.addr))
        .body(())
        .unwrap();
    let (resp, _) = h2c.send_request(req, true).unwrap();
    assert_eq!(resp.await.unwrap().status(), 200);
    let text = g.metrics_text().await;
    assert!(floods(&text) - before >= 1.0, "{text}");

    // With the defaults, a flood ends the connection too (whichever cap trips first).
    let d = TestGateway::start("").await;
    assert!(
        reset_flood(d.addr, 2000, Duration::from_secs(5)).await,
        "the connection survived a reset flood with the default limits"
    );
    assert_eq!(c.get(d.url("/healthz")).send().await.unwrap().status(), 200);
}
