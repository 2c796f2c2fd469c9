//! Hostile and malformed client input through real HTTP: every case gets a clear OpenAI-shaped
//! 4xx (or hyper's bare 400 for a request that is not valid HTTP), nothing reaches a backend,
//! nothing panics or hangs, and the gateway keeps serving.
//!
//! Covered: invalid UTF-8 in bodies and header values, deep nesting, huge and non-integer
//! numbers, duplicate keys (the gateway must never authorise one `model` while the backend reads
//! another), wrong types and nulls for every routed field, message edge cases, conflicting
//! message framing (Content-Length / Transfer-Encoding) on a raw socket.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const OK_CHAT: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"allowed","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

/// A recording backend serving `allowed` and `secret`, a gateway in front of it with one key
/// allowed only `allowed`. Returns (gateway, backend, key).
async fn setup(extra: &str) -> (TestGateway, ScriptedBackend, String) {
    let b = ScriptedBackend::start(
        200,
        vec![("content-type", "application/json".into())],
        OK_CHAT.into(),
    )
    .await;
    let (key, hash) = sluice::auth::mint();
    let g = TestGateway::start_healthy(&format!(
        "{extra}\n{FAST_HEALTH}{}\n[[keys]]\nname = \"alice\"\nhash = \"{hash}\"\nmodels = [\"allowed\"]\n",
        backend("b", "openai", &b.url(), &["allowed", "secret"])
    ))
    .await;
    (g, b, key)
}

async fn post(
    g: &TestGateway,
    key: &str,
    path: &str,
    body: impl Into<reqwest::Body>,
) -> reqwest::Response {
    client()
        .post(g.url(path))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap()
}

/// Assert an OpenAI-shaped error with `status`; returns the `error` object.
async fn openai_error(resp: reqwest::Response, status: u16, what: &str) -> Value {
    assert_eq!(resp.status().as_u16(), status, "{what}");
    let ct = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("application/json"), "{what}: {ct}");
    let v: Value = resp.json().await.unwrap();
    let e = v["error"].clone();
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
    assert!(e["type"].is_string(), "{what}: {v}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{what}: {v}"
    );
    e
}

/// The gateway still answers a normal request.
async fn still_serves(g: &TestGateway, key: &str) {
    let resp = client()
        .post(g.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&chat_body("allowed", false, 2))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

fn chat_with(fields: &str) -> String {
    format!(r#"{{"model":"allowed",{fields},"messages":[{{"role":"user","content":"x"}}]}}"#)
}

/// Write `bytes` on a fresh connection and read until the server closes or `within` passes.
/// Returns what was read and whether the server closed the connection.
async fn raw_exchange(addr: SocketAddr, bytes: &[u8], within: Duration) -> (String, bool) {
    let mut sock = TcpStream::connect(addr).await.unwrap();
    sock.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, sock.read(&mut buf)).await {
            Err(_) => return (String::from_utf8_lossy(&out).into_owned(), false),
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into_owned(), true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

fn status_of(response: &str) -> u16 {
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn invalid_utf8_in_the_body_is_a_400() {
    let (g, b, key) = setup("").await;
    let bodies: Vec<Vec<u8>> = vec![
        // in a message
        [
            &br#"{"model":"allowed","messages":[{"role":"user","content":"a"#[..],
            &[0xff, 0xfe, 0x80],
            &br#""}]}"#[..],
        ]
        .concat(),
        // in the routed model name
        [
            &br#"{"model":"allo"#[..],
            &[0xc3, 0x28],
            &br#"wed","messages":[{"role":"user","content":"x"}]}"#[..],
        ]
        .concat(),
        // in a key
        [
            &br#"{"model":"allowed",""#[..],
            &[0xed, 0xa0, 0x80],
            &br#"":1,"messages":[{"role":"user","content":"x"}]}"#[..],
        ]
        .concat(),
        // a lone surrogate escape in the model name
        br#"{"model":"\ud800","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        // a UTF-8 byte order mark before the object
        [&[0xef, 0xbb, 0xbf][..], chat_with(r#""n":1"#).as_bytes()].concat(),
    ];
    for body in bodies {
        let what = String::from_utf8_lossy(&body).into_owned();
        openai_error(
            post(&g, &key, "/v1/chat/completions", body).await,
            400,
            &what,
        )
        .await;
    }
    assert!(
        b.inference_requests().is_empty(),
        "a malformed body was forwarded"
    );
    still_serves(&g, &key).await;
    g.stop().await;
}

#[tokio::test]
async fn invalid_utf8_in_header_values() {
    let (g, b, key) = setup("").await;
    let body = chat_with(r#""max_tokens":2"#);
    let request = |headers: &[u8]| {
        [
            &b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"[..],
            headers,
            format!("content-length: {}\r\n\r\n{body}", body.len()).as_bytes(),
        ]
        .concat()
    };
    let wait = Duration::from_secs(5);
    // A key that is not UTF-8: an ordinary 401.
    let (resp, _) = raw_exchange(
        g.addr,
        &request(b"authorization: Bearer sk-\xff\xfe\r\ncontent-type: application/json\r\n"),
        wait,
    )
    .await;
    assert_eq!(status_of(&resp), 401, "{resp}");
    assert!(resp.contains("\"error\""), "{resp}");
    // A content type that is not UTF-8: 415.
    let auth = format!("authorization: Bearer {key}\r\n");
    let (resp, _) = raw_exchange(
        g.addr,
        &request(&[auth.as_bytes(), b"content-type: application/json\xff\r\n"].concat()),
        wait,
    )
    .await;
    assert_eq!(status_of(&resp), 415, "{resp}");
    assert!(resp.contains("unsupported_media_type"), "{resp}");
    // A request id that is not UTF-8 is replaced by a fresh one; the request is served.
    let (resp, _) = raw_exchange(
        g.addr,
        &request(&[auth.as_bytes(), b"x-request-id: id-\xff\xfe\r\n"].concat()),
        wait,
    )
    .await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    let id = resp
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .unwrap_or("")
        .trim();
    assert_eq!(id.len(), 32, "{resp}");
    assert_eq!(b.inference_requests().len(), 1);
    assert!(b.inference_requests()[0].headers["x-request-id"] == id);
    // Other non-UTF-8 header values are forwarded as opaque bytes or dropped, never a crash.
    let (resp, _) = raw_exchange(
        g.addr,
        &request(
            &[
                auth.as_bytes(),
                b"x-custom: \xff\xfe\xfd\r\nuser-agent: \x80\r\n",
            ]
            .concat(),
        ),
        wait,
    )
    .await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    // A header name with non-token bytes is not HTTP: hyper's bare 400, nothing forwarded.
    let (resp, closed) = raw_exchange(g.addr, &request(b"x-\xffname: 1\r\n"), wait).await;
    assert_eq!(status_of(&resp), 400, "{resp}");
    assert!(closed);
    assert_eq!(b.inference_requests().len(), 2);
    still_serves(&g, &key).await;
    g.stop().await;
}

#[tokio::test]
async fn deep_nesting_is_refused_through_http() {
    let (g, b, key) = setup("").await;
    let nested = |depth: usize| {
        // The top-level object is the first level.
        format!(
            r#"{{"model":"allowed","messages":[{{"role":"user","content":"x"}}],"x":{}{}}}"#,
            "[".repeat(depth - 1),
            "]".repeat(depth - 1)
        )
    };
    for depth in [129, 1000, 200_000] {
        let started = Instant::now();
        let e = openai_error(
            post(&g, &key, "/v1/chat/completions", nested(depth)).await,
            400,
            &format!("depth {depth}"),
        )
        .await;
        assert_eq!(e["code"], "invalid_json");
        assert!(e["message"].as_str().unwrap().contains("128"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
    // Deep nesting inside a message's content is refused the same way.
    let deep_content = format!(
        r#"{{"model":"allowed","messages":[{{"role":"user","content":{}{}}}]}}"#,
        "{\"a\":".repeat(500),
        "1".to_string() + &"}".repeat(500)
    );
    openai_error(
        post(&g, &key, "/v1/chat/completions", deep_content).await,
        400,
        "content",
    )
    .await;
    // An unterminated deep body: still a 400, not a hang.
    openai_error(
        post(&g, &key, "/v1/chat/completions", "{\"x\":".repeat(100_000)).await,
        400,
        "unterminated",
    )
    .await;
    assert!(b.inference_requests().is_empty());
    // 128 levels are fine, and so are brackets inside strings.
    let resp = post(&g, &key, "/v1/chat/completions", nested(128)).await;
    assert_eq!(resp.status(), 200);
    let in_string = format!(
        r#"{{"model":"allowed","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "[{".repeat(10_000)
    );
    assert_eq!(
        post(&g, &key, "/v1/chat/completions", in_string)
            .await
            .status(),
        200
    );
    g.stop().await;
}

#[tokio::test]
async fn huge_negative_and_non_integer_numbers_are_400() {
    let (g, b, key) = setup("").await;
    let values = [
        "1e400",
        "-1e400",
        "18446744073709551616",
        "18446744073709551615",
        "99999999999999999999999999999999999999",
        "1e20",
        "1E2",
        "1.5",
        "10.0",
        "-1",
        "-0",
        "\"10\"",
        "true",
        "[]",
        "{}",
        "[10]",
    ];
    for field in ["max_tokens", "max_completion_tokens", "n"] {
        for v in values {
            let body = chat_with(&format!(r#""{field}":{v}"#));
            let e = openai_error(
                post(&g, &key, "/v1/chat/completions", body).await,
                400,
                &format!("{field}={v}"),
            )
            .await;
            assert_eq!(e["param"], field, "{field}={v}: {e}");
            assert_eq!(e["type"], "invalid_request_error");
        }
    }
    // Completions read the same fields.
    for v in ["1e400", "-1", "2.5"] {
        let body = format!(r#"{{"model":"allowed","prompt":"x","max_tokens":{v}}}"#);
        openai_error(post(&g, &key, "/v1/completions", body).await, 400, v).await;
    }
    assert!(b.inference_requests().is_empty());
    // Huge numbers in fields the gateway does not read are the backend's business: forwarded
    // byte for byte, no crash.
    let body = chat_with(r#""temperature":1e400,"seed":18446744073709551616000"#);
    let resp = post(&g, &key, "/v1/chat/completions", body.clone()).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(b.inference_requests()[0].body, body.as_bytes());
    g.stop().await;
}

#[tokio::test]
async fn absurd_max_tokens_is_400_at_the_gateway_or_the_backend() {
    // Up to the built-in cap (16 Mi) the answer is vLLM's against the model's context (the
    // gateway gives it itself once it learned the window); above the cap the gateway answers
    // itself and nothing is forwarded.
    // The backend's request count must move only with forwarded requests: one probe at start
    // and no signals scraping, so no probe lands between the two readings however slow the
    // machine is.
    let s = sim(sluice::sim::SimKind::Vllm, &["m"]).await;
    let g = TestGateway::start_healthy(&format!(
        "[health]\ninterval = \"1h\"\ntimeout = \"500ms\"\nhealthy_threshold = 1\nsignals_interval = \"0s\"\n{}",
        backend("v", "vllm", &s.url(), &["m"])
    ))
    .await;
    let body = |n: u64| {
        format!(r#"{{"model":"m","max_tokens":{n},"messages":[{{"role":"user","content":"x"}}]}}"#)
    };
    let limit = sluice::openai::request::MAX_TOKENS_LIMIT;
    let e = openai_error(
        post(&g, "k", "/v1/chat/completions", body(limit)).await,
        400,
        "at cap",
    )
    .await;
    assert!(
        e["message"].as_str().unwrap().contains("max_model_len"),
        "{e}"
    );
    let before = s.state()["counters"]["requests_total"].clone();
    for n in [limit + 1, u64::MAX] {
        let e = openai_error(
            post(&g, "k", "/v1/chat/completions", body(n)).await,
            400,
            "above cap",
        )
        .await;
        assert_eq!(e["param"], "max_tokens");
        assert!(
            e["message"].as_str().unwrap().contains(&limit.to_string()),
            "{e}"
        );
    }
    let e = openai_error(
        post(
            &g,
            "k",
            "/v1/chat/completions",
            chat_with_model("m", r#""max_completion_tokens":99999999999"#),
        )
        .await,
        400,
        "max_completion_tokens above cap",
    )
    .await;
    assert_eq!(e["param"], "max_completion_tokens");
    assert_eq!(
        s.state()["counters"]["requests_total"],
        before,
        "refused requests reached the backend"
    );
    // n beyond its cap as well.
    let e = openai_error(
        post(
            &g,
            "k",
            "/v1/chat/completions",
            chat_with_model("m", r#""n":129"#),
        )
        .await,
        400,
        "n",
    )
    .await;
    assert_eq!(e["param"], "n");
    g.stop().await;
}

fn chat_with_model(model: &str, fields: &str) -> String {
    format!(r#"{{"model":"{model}",{fields},"messages":[{{"role":"user","content":"x"}}]}}"#)
}

#[tokio::test]
async fn duplicate_routed_keys_are_refused_so_the_allow_list_cannot_be_bypassed() {
    let (g, b, key) = setup("").await;
    let msg = r#""messages":[{"role":"user","content":"x"}]"#;
    let chat_cases = [
        // The allow-list check reads one value, a last-wins backend would read the other.
        format!(r#"{{"model":"allowed","model":"secret",{msg}}}"#),
        format!(r#"{{"model":"secret","model":"allowed",{msg}}}"#),
        // The same key spelled with an escape is the same key.
        format!(r#"{{"model":"allowed","mod\u0065l":"secret",{msg}}}"#),
        format!(r#"{{"\u006dodel":"secret","model":"allowed",{msg}}}"#),
        format!(r#"{{"model":"allowed","stream":false,"stream":true,{msg}}}"#),
        format!(r#"{{"model":"allowed","max_tokens":1,"max_tokens":1000000,{msg}}}"#),
        format!(
            r#"{{"model":"allowed","max_completion_tokens":1,"max_completion_tokens":100000,{msg}}}"#
        ),
        format!(r#"{{"model":"allowed","n":1,"n":100,{msg}}}"#),
        format!(
            r#"{{"model":"allowed","stream":true,"stream_options":{{"include_usage":true}},"stream_options":null,{msg}}}"#
        ),
        format!(
            r#"{{"model":"allowed","stream":true,"stream_options":{{"include_usage":true,"include_usage":false}},{msg}}}"#
        ),
        format!(
            r#"{{"model":"allowed",{msg},"messages":[{{"role":"user","content":"a much longer prompt"}}]}}"#
        ),
        r#"{"model":"allowed","messages":[{"role":"user","role":"system","content":"x"}]}"#
            .to_string(),
        // A second JSON value after the object (a last-object-wins parser would route it).
        format!(r#"{{"model":"allowed",{msg}}}{{"model":"secret",{msg}}}"#),
    ];
    for body in &chat_cases {
        let e = openai_error(
            post(&g, &key, "/v1/chat/completions", body.clone()).await,
            400,
            body,
        )
        .await;
        assert_eq!(e["type"], "invalid_request_error", "{body}: {e}");
    }
    for (path, body) in [
        (
            "/v1/completions",
            r#"{"model":"allowed","prompt":"a","prompt":"bb"}"#,
        ),
        (
            "/v1/completions",
            r#"{"model":"allowed","model":"secret","prompt":"a"}"#,
        ),
        (
            "/v1/embeddings",
            r#"{"model":"allowed","input":"a","input":["b"]}"#,
        ),
        (
            "/v1/embeddings",
            r#"{"model":"secret","model":"allowed","input":"a"}"#,
        ),
    ] {
        openai_error(post(&g, &key, path, body).await, 400, body).await;
    }
    assert!(
        b.inference_requests().is_empty(),
        "a body with duplicate routed keys reached the backend"
    );
    // The allow-list itself: `secret` is refused, `allowed` is served.
    let e = openai_error(
        post(
            &g,
            &key,
            "/v1/chat/completions",
            format!(r#"{{"model":"secret",{msg}}}"#),
        )
        .await,
        403,
        "secret",
    )
    .await;
    assert_eq!(e["param"], "model");
    still_serves(&g, &key).await;
    // Duplicates of fields the gateway does not route on are the backend's business.
    let body = format!(r#"{{"model":"allowed","temperature":0,"temperature":1,{msg}}}"#);
    assert_eq!(
        post(&g, &key, "/v1/chat/completions", body).await.status(),
        200
    );
    g.stop().await;
}

#[tokio::test]
async fn wrong_types_of_every_routed_field_are_400_with_the_param() {
    let (g, b, key) = setup("").await;
    let msg = r#""messages":[{"role":"user","content":"x"}]"#;
    let mut cases: Vec<(&str, String, &str)> = Vec::new();
    for v in ["7", "true", "[]", "{}", "[\"allowed\"]", "\"\""] {
        cases.push((
            "/v1/chat/completions",
            format!(r#"{{"model":{v},{msg}}}"#),
            "model",
        ));
    }
    for v in ["\"yes\"", "\"true\"", "1", "0", "[]", "{}"] {
        cases.push((
            "/v1/chat/completions",
            chat_with(&format!(r#""stream":{v}"#)),
            "stream",
        ));
    }
    for v in ["\"x\"", "[]", "1", "true"] {
        cases.push((
            "/v1/chat/completions",
            chat_with(&format!(r#""stream":true,"stream_options":{v}"#)),
            "stream_options",
        ));
    }
    for v in ["\"yes\"", "1", "[]", "{}"] {
        cases.push((
            "/v1/chat/completions",
            chat_with(&format!(
                r#""stream":true,"stream_options":{{"include_usage":{v}}}"#
            )),
            "stream_options.include_usage",
        ));
    }
    for v in ["\"hi\"", "{}", "7", "true", "[1]", "[\"x\"]", "[[]]"] {
        cases.push((
            "/v1/chat/completions",
            format!(r#"{{"model":"allowed","messages":{v}}}"#),
            "messages",
        ));
    }
    for v in ["7", "true", "{}", "{\"text\":\"x\"}"] {
        cases.push((
            "/v1/completions",
            format!(r#"{{"model":"allowed","prompt":{v}}}"#),
            "prompt",
        ));
        cases.push((
            "/v1/embeddings",
            format!(r#"{{"model":"allowed","input":{v}}}"#),
            "input",
        ));
    }
    for (path, body, param) in &cases {
        let e = openai_error(post(&g, &key, path, body.clone()).await, 400, body).await;
        assert_eq!(e["param"], *param, "{body}: {e}");
    }
    assert!(
        b.inference_requests().is_empty(),
        "a mistyped body was forwarded"
    );
    // Every accepted shape of prompt and input is forwarded.
    for (path, body) in [
        ("/v1/completions", r#"{"model":"allowed","prompt":"x"}"#),
        (
            "/v1/completions",
            r#"{"model":"allowed","prompt":["x","y"]}"#,
        ),
        ("/v1/completions", r#"{"model":"allowed","prompt":[1,2,3]}"#),
        (
            "/v1/completions",
            r#"{"model":"allowed","prompt":[[1,2],[3]]}"#,
        ),
        ("/v1/embeddings", r#"{"model":"allowed","input":"x"}"#),
        ("/v1/embeddings", r#"{"model":"allowed","input":["x"]}"#),
        ("/v1/embeddings", r#"{"model":"allowed","input":[[1,2]]}"#),
    ] {
        assert_eq!(post(&g, &key, path, body).await.status(), 200, "{body}");
    }
    g.stop().await;
}

#[tokio::test]
async fn messages_roles_and_null_fields() {
    let (g, b, key) = setup("").await;
    for (body, param) in [
        (r#"{"model":"allowed","messages":[]}"#, "messages"),
        (r#"{"model":"allowed"}"#, "messages"),
        (r#"{"model":"allowed","messages":null}"#, "messages"),
        (
            r#"{"model":"allowed","messages":[{"role":"robot","content":"x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"model":"allowed","messages":[{"role":"User","content":"x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"model":"allowed","messages":[{"role":"user","content":"x"},{"role":"","content":"y"}]}"#,
            "messages[1].role",
        ),
        (
            r#"{"model":"allowed","messages":[{"role":null,"content":"x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"model":"allowed","messages":[{"role":7,"content":"x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"model":"allowed","messages":[{"content":"x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"model":null,"messages":[{"role":"user","content":"x"}]}"#,
            "model",
        ),
        (r#"{"model":"allowed","prompt":null}"#, "messages"),
    ] {
        let e = openai_error(
            post(&g, &key, "/v1/chat/completions", body).await,
            400,
            body,
        )
        .await;
        assert_eq!(e["param"], param, "{body}: {e}");
    }
    for (path, body, param) in [
        (
            "/v1/completions",
            r#"{"model":"allowed","prompt":null}"#,
            "prompt",
        ),
        (
            "/v1/embeddings",
            r#"{"model":"allowed","input":null}"#,
            "input",
        ),
    ] {
        let e = openai_error(post(&g, &key, path, body).await, 400, body).await;
        assert_eq!(e["param"], param, "{body}: {e}");
    }
    assert!(b.inference_requests().is_empty());
    // Optional fields set to null mean "not given".
    let body =
        chat_with(r#""stream":null,"max_tokens":null,"max_completion_tokens":null,"n":null"#);
    assert_eq!(
        post(&g, &key, "/v1/chat/completions", body).await.status(),
        200
    );
    g.stop().await;
}

#[tokio::test]
async fn stream_options_null_is_replaced_not_duplicated() {
    // With `stream_options: null` the gateway still needs usage: it must replace the null, not
    // add a second `stream_options` key (a last-wins backend would then read the null).
    let b = ScriptedBackend::start(
        200,
        vec![("content-type", "text/event-stream".into())],
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n".into(),
    )
    .await;
    let g = TestGateway::one_backend("b", "openai", &b.url()).await;
    let body = r#"{"model":"m","stream":true,"stream_options":null,"messages":[{"role":"user","content":"x"}]}"#;
    let resp = post(&g, "k", "/v1/chat/completions", body).await;
    assert_eq!(resp.status(), 200);
    let _ = resp.text().await.unwrap();
    let sent = String::from_utf8(b.inference_requests()[0].body.to_vec()).unwrap();
    assert_eq!(sent.matches("stream_options").count(), 1, "{sent}");
    let v: Value = serde_json::from_str(&sent).unwrap();
    assert_eq!(v["stream_options"]["include_usage"], true, "{sent}");
    g.stop().await;
}

#[tokio::test]
async fn conflicting_framing_is_refused_and_the_connection_closed() {
    let (g, b, key) = setup("").await;
    let body = chat_with(r#""max_tokens":2"#);
    let smuggled_body = chat_with(r#""max_tokens":3"#);
    let smuggled = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-length: {}\r\n\r\n{smuggled_body}",
        smuggled_body.len()
    );
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\n"
    );
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    // Content-Length with Transfer-Encoding: hyper drops the length before the request reaches
    // the gateway's code and reads the chunked body (RFC 9112 6.1: Transfer-Encoding wins), then
    // closes the connection after the response, so the bytes behind the chunked body (a
    // smuggled second request) are never read as a request.
    for (what, request) in [
        (
            "content-length and chunked",
            format!(
                "{head}content-length: {}\r\ntransfer-encoding: chunked\r\n\r\n{chunked}{smuggled}",
                body.len()
            ),
        ),
        (
            "chunked and content-length",
            format!(
                "{head}transfer-encoding: chunked\r\ncontent-length: 4\r\n\r\n{chunked}{smuggled}"
            ),
        ),
    ] {
        let before = b.inference_requests().len();
        let (resp, closed) = raw_exchange(g.addr, request.as_bytes(), Duration::from_secs(5)).await;
        assert!(closed, "{what}: connection left open: {resp}");
        assert_eq!(
            resp.matches("HTTP/1.1").count(),
            1,
            "{what}: the smuggled request was served: {resp}"
        );
        let seen = b.inference_requests();
        assert_eq!(seen.len(), before + 1, "{what}");
        assert_eq!(
            seen[before].body,
            body.as_bytes(),
            "{what}: not the chunked body"
        );
    }
    let forwarded = b.inference_requests().len();
    let cases: Vec<(&str, String)> = vec![
        (
            "two different content-lengths",
            format!(
                "{head}content-length: {}\r\ncontent-length: 5\r\n\r\n{body}",
                body.len()
            ),
        ),
        (
            "a content-length list",
            format!("{head}content-length: {0}, {0}\r\n\r\n{body}", body.len()),
        ),
        (
            "a content-length that is not a number",
            format!("{head}content-length: 1x\r\n\r\n{body}"),
        ),
        (
            "a negative content-length",
            format!("{head}content-length: -1\r\n\r\n{body}"),
        ),
        (
            "chunked not last",
            format!("{head}transfer-encoding: chunked, gzip\r\n\r\n{chunked}"),
        ),
        (
            "an unknown transfer coding",
            format!("{head}transfer-encoding: gzip\r\n\r\n{body}"),
        ),
        (
            "a bad chunk size",
            format!("{head}transfer-encoding: chunked\r\n\r\nzz\r\n{body}\r\n0\r\n\r\n"),
        ),
    ];
    for (what, request) in &cases {
        let (resp, closed) = raw_exchange(g.addr, request.as_bytes(), Duration::from_secs(5)).await;
        assert_eq!(status_of(&resp), 400, "{what}: {resp}");
        assert!(closed, "{what}: connection left open");
        assert_eq!(
            resp.matches("HTTP/1.1").count(),
            1,
            "{what}: a second request was served: {resp}"
        );
    }
    assert_eq!(
        b.inference_requests().len(),
        forwarded,
        "a request with conflicting framing was forwarded"
    );
    // Two equal lengths mean one length (RFC 9110 8.6); every reader agrees, hyper keeps one.
    let (resp, _) = raw_exchange(
        g.addr,
        format!(
            "{head}content-length: {0}\r\ncontent-length: {0}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    assert_eq!(b.inference_requests().len(), forwarded + 1);
    // A well-framed chunked request is served.
    let (resp, _) = raw_exchange(
        g.addr,
        format!("{head}transfer-encoding: chunked\r\nconnection: close\r\n\r\n{chunked}")
            .as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status_of(&resp), 200, "{resp}");
    still_serves(&g, &key).await;
    g.stop().await;
}
