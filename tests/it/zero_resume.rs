//! Mid-stream continuation (issue 18 item 3): a stream that breaks after tokens reached the
//! client is continued on another backend and reads as one unbroken answer — checked chunk by
//! chunk against the same answer produced without a break; requests that cannot be continued
//! faithfully, continuation switched off and a continuation that fails itself keep the
//! terminal error.

use std::time::Duration;

use serde_json::{json, Value};
use sluice::sim::{Fault, FaultMode, SimKind};

use crate::support;
use support::raw::{bad_backend, Misbehaviour};
use support::*;

const MODEL: &str = "m";

/// A gateway over `backends` (name, kind, url) serving [`MODEL`], round-robin, naming the
/// backend that answered; `extra`: more config.
async fn gateway(backends: &[(&str, &str, String)], extra: &str) -> TestGateway {
    let mut t = format!(
        "[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n{extra}\n{FAST_HEALTH}"
    );
    for (name, kind, url) in backends {
        t.push_str(&backend(name, kind, url, &[MODEL]));
    }
    TestGateway::start_healthy(&t).await
}

/// A vLLM sim whose streams are cut after `chunks` chunks (the role chunk, then tokens).
async fn cutting_sim(chunks: u32) -> sluice::sim::SimHandle {
    let s = sim(SimKind::Vllm, &[MODEL]).await;
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = chunks;
    s.set_fault(fault).unwrap();
    s
}

/// A sim cutting its streams after `chunks` chunks (named `cut` in the gateway), a healthy
/// vLLM sim (`b`), and the gateway over both; `extra`: more config.
async fn cut_and_healthy(
    chunks: u32,
    cut: &str,
    extra: &str,
) -> (sluice::sim::SimHandle, sluice::sim::SimHandle, TestGateway) {
    let (a, b) = (
        cutting_sim(chunks).await,
        sim(SimKind::Vllm, &[MODEL]).await,
    );
    let g = gateway(&[(cut, "vllm", a.url()), ("b", "vllm", b.url())], extra).await;
    (a, b, g)
}

/// Run the SDK check script `script` against `g` (the SDK's base URL `g`'s `base`), which
/// must read `want` as the answer, then check that `cut` had a stream continued; `env`: more
/// for the script.
async fn sdk_reads_the_continuation(
    python: std::path::PathBuf,
    script: &str,
    g: &TestGateway,
    base: &str,
    want: String,
    cut: &str,
    env: Vec<(&'static str, String)>,
) {
    let mut vars = vec![
        ("SLUICE_BASE_URL", g.url(base)),
        ("SLUICE_MODEL", MODEL.to_string()),
        ("SLUICE_WANT_TEXT", want),
    ];
    vars.extend(env);
    process::python_checks(python, script, vars).await;
    let metrics = g.metrics_text().await;
    let continued =
        format!("sluice_stream_continuations_total{{backend=\"{cut}\",outcome=\"continued\"}}");
    assert!(
        metric(&metrics, &continued) >= 1.0,
        "no stream was continued: {metrics}"
    );
}

/// Post `body` to `path` until the stream starts on `first` (round-robin: within a few
/// tries); the event payloads it delivered.
async fn stream_from(g: &TestGateway, path: &str, body: &Value, first: &str) -> Vec<String> {
    let c = client();
    for _ in 0..4 {
        let r = post_json(&c, g.url(path), body).await;
        assert_eq!(r.status(), 200);
        let on = header(&r, "x-sluice-backend").to_string();
        let text = r.text().await.unwrap();
        if on == first {
            return payloads(&text);
        }
    }
    panic!("no stream started on {first}");
}

fn payloads(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// The reference: the same request answered whole by a healthy sim, streamed.
async fn reference(url: &str, path: &str, body: &Value) -> Vec<String> {
    let r = post_json(&client(), format!("{url}{path}"), body).await;
    payloads(&r.text().await.unwrap())
}

/// What a chat or completions stream says: its chunks' JSON, the text, the finishes, the
/// role deltas, the usage.
struct Read {
    chunks: Vec<Value>,
    text: String,
    finishes: Vec<String>,
    roles: usize,
    usage: Option<Value>,
    errors: usize,
    done: bool,
}

fn read(payloads: &[String]) -> Read {
    let mut r = Read {
        chunks: Vec::new(),
        text: String::new(),
        finishes: Vec::new(),
        roles: 0,
        usage: None,
        errors: 0,
        done: false,
    };
    for p in payloads {
        if p == "[DONE]" {
            r.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(p).unwrap_or_else(|e| panic!("{e}: {p}"));
        if v.get("error").is_some() {
            r.errors += 1;
            continue;
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            r.text += c["delta"]["content"].as_str().unwrap_or("");
            r.text += c["text"].as_str().unwrap_or("");
            if c["delta"].get("role").is_some() {
                r.roles += 1;
            }
            if let Some(f) = c["finish_reason"].as_str() {
                r.finishes.push(f.to_string());
            }
        }
        if !v["usage"].is_null() {
            r.usage = Some(v["usage"].clone());
        }
        r.chunks.push(v);
    }
    r
}

/// The continued stream `got` is the reference answer `want`, unbroken: one id, created and
/// model on every chunk (the first's), one role delta (chat), the same text, one finish,
/// usage summed over both attempts.
fn assert_unbroken(got: &Read, want: &Read, chat: bool) {
    assert_eq!(got.errors, 0, "an error event reached the client");
    assert!(got.done, "no [DONE]");
    let first = &got.chunks[0];
    for c in &got.chunks {
        for k in ["id", "created", "model"] {
            assert_eq!(c[k], first[k], "{k} changed mid-stream: {c}");
        }
    }
    assert_eq!(first["model"], MODEL);
    assert_eq!(got.roles, usize::from(chat), "role deltas");
    assert_eq!(got.text, want.text, "the text is the uncut answer's");
    assert_eq!(
        got.finishes, want.finishes,
        "one finish, the uncut answer's"
    );
    let (g, w) = (got.usage.as_ref().unwrap(), want.usage.as_ref().unwrap());
    assert_eq!(g["completion_tokens"], w["completion_tokens"], "{g} vs {w}");
    // The prompt as the continuing engine counts it without the text streamed: the original
    // prompt, to within the token a tokenizer may merge across the join.
    let (gp, wp) = (
        g["prompt_tokens"].as_u64().unwrap(),
        w["prompt_tokens"].as_u64().unwrap(),
    );
    assert!(gp == wp || gp + 1 == wp, "prompt {gp} vs {wp}");
    assert_eq!(
        g["total_tokens"].as_u64().unwrap(),
        gp + g["completion_tokens"].as_u64().unwrap()
    );
}

fn chat(max_tokens: u32) -> Value {
    json!({"model": MODEL, "stream": true, "max_tokens": max_tokens, "seed": 7,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Tell me about the sea."}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_stream_cut_after_tokens_continues_unbroken_on_another_backend() {
    let (_a, b, g) = cut_and_healthy(6, "cut-chat", "[admin]\nlisten = \"127.0.0.1:0\"\n").await;
    let body = chat(40);
    let want = read(&reference(&b.url(), "/v1/chat/completions", &body).await);
    assert!(want.chunks.len() > 10, "the answer is longer than the cut");
    let got = read(&stream_from(&g, "/v1/chat/completions", &body, "cut-chat").await);
    assert_unbroken(&got, &want, true);

    // Counted once, with the answer's usage; the continuation is visible in the metrics.
    let c = client();
    let u = got.usage.clone().unwrap();
    eventually(Duration::from_secs(3), "usage counted once", || {
        let (c, url, u) = (c.clone(), g.admin_url("/admin/usage"), u.clone());
        async move {
            let v = get_json(&c, url).await;
            let rows = v["rows"].as_array().cloned().unwrap_or_default();
            let sum = |k: &str| rows.iter().filter_map(|r| r[k].as_u64()).sum::<u64>();
            let requests = v["tenants"].as_object().map(|t| {
                t.values()
                    .filter_map(|t| t["requests"].as_u64())
                    .sum::<u64>()
            });
            requests == Some(1)
                && Some(sum("completion_tokens")) == u["completion_tokens"].as_u64()
                && Some(sum("prompt_tokens")) == u["prompt_tokens"].as_u64()
        }
    })
    .await;
    let metrics = g.metrics_text().await;
    assert_eq!(
        metric(
            &metrics,
            "sluice_stream_continuations_total{backend=\"cut-chat\",outcome=\"continued\"}"
        ),
        1.0,
        "{metrics}"
    );
    g.stop().await;
}

/// TGI (`continue_final_message`) and Ollama (a trailing assistant message) continue a chat
/// answer too; their own chunk shapes (TGI's empty id, the role on every delta) are rewritten
/// to the first chunk's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_and_ollama_continue_a_chat_answer() {
    for (kind, label) in [
        (SimKind::Tgi, "cut-to-tgi"),
        (SimKind::Ollama, "cut-to-ollama"),
    ] {
        let (a, b) = (cutting_sim(6).await, sim(SimKind::Vllm, &[MODEL]).await);
        let other = sim(kind, &[MODEL]).await;
        let name = if kind == SimKind::Tgi {
            "tgi"
        } else {
            "ollama"
        };
        let g = gateway(&[(label, "vllm", a.url()), ("o", name, other.url())], "").await;
        let body = chat(40);
        let want = read(&reference(&b.url(), "/v1/chat/completions", &body).await);
        let got = read(&stream_from(&g, "/v1/chat/completions", &body, label).await);
        assert_eq!(got.errors, 0, "{label}");
        let first = &got.chunks[0];
        assert!(first["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-")));
        for c in &got.chunks {
            for k in ["id", "created", "model"] {
                assert_eq!(c[k], first[k], "{label}: {k} changed mid-stream: {c}");
            }
        }
        // The five tokens that went out, then what that engine answers when asked to continue
        // them (another engine's model may continue differently).
        let partial: String = want.text.split_inclusive(' ').take(6).collect();
        let partial = partial.trim_end().to_string();
        let mut direct = body.clone();
        direct["stream"] = json!(false);
        direct.as_object_mut().unwrap().remove("stream_options");
        direct["max_tokens"] = json!(35);
        direct["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "assistant", "content": partial}));
        if kind == SimKind::Tgi {
            direct["continue_final_message"] = json!(true);
        }
        let rest = support::request::post_for_json(
            &client(),
            other.url() + "/v1/chat/completions",
            &direct,
        )
        .await;
        let rest = rest["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(got.roles, 1, "{label}");
        assert_eq!(got.text, format!("{partial}{rest}"), "{label}");
        assert_eq!(got.finishes.len(), 1, "{label}");
        let u = got.usage.unwrap();
        assert_eq!(
            u["completion_tokens"].as_u64().unwrap(),
            got.text.split_whitespace().count() as u64,
            "{label}: {u}"
        );
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completions_stream_continues_with_the_text_so_far() {
    let (_a, b, g) = cut_and_healthy(4, "cut-cmpl", "").await;
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 30, "seed": 3,
        "stream_options": {"include_usage": true}, "prompt": "Once upon a time"});
    let want = read(&reference(&b.url(), "/v1/completions", &body).await);
    let got = read(&stream_from(&g, "/v1/completions", &body, "cut-cmpl").await);
    assert_unbroken(&got, &want, false);
    // max_tokens counted once: the answer stops at the client's limit, not 30 more.
    let capped = json!({"model": MODEL, "stream": true, "max_tokens": 8, "seed": 3,
        "stream_options": {"include_usage": true}, "prompt": "Once upon a time"});
    let want = read(&reference(&b.url(), "/v1/completions", &capped).await);
    let got = read(&stream_from(&g, "/v1/completions", &capped, "cut-cmpl").await);
    assert_eq!(want.finishes, ["length"]);
    assert_unbroken(&got, &want, false);
    assert_eq!(got.usage.unwrap()["completion_tokens"], 8);
    g.stop().await;
}

/// Without `include_usage` the client gets no usage chunk from the continuation either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_usage_stays_hidden_after_a_continuation() {
    let (_a, b, g) = cut_and_healthy(3, "cut-hidden", "").await;
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 20, "seed": 5,
        "messages": [{"role": "user", "content": "hi"}]});
    let want = read(&reference(&b.url(), "/v1/chat/completions", &body).await);
    let got = read(&stream_from(&g, "/v1/chat/completions", &body, "cut-hidden").await);
    assert!(got.usage.is_none() && want.usage.is_none());
    assert_eq!(
        (got.text, got.finishes, got.roles),
        (want.text, want.finishes, 1)
    );
    g.stop().await;
}

/// An engine's error event and an idle backend are breaks too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_or_a_silent_backend_is_continued() {
    for how in [Misbehaviour::SseErrorEvent, Misbehaviour::Stall] {
        let raw = bad_backend(how).await;
        let b = sim(SimKind::Vllm, &[MODEL]).await;
        let g = gateway(
            &[("raw", "vllm", raw), ("b", "vllm", b.url())],
            "[timeouts]\nidle = \"300ms\"\n",
        )
        .await;
        let got = read(&stream_from(&g, "/v1/chat/completions", &chat(20), "raw").await);
        assert_eq!(got.errors, 0, "{how:?}");
        assert!(
            got.done && got.text.starts_with("Hi"),
            "{how:?}: {}",
            got.text
        );
        assert!(got.text.len() > "HiHi".len(), "{how:?}: {}", got.text);
        assert_eq!(got.finishes.len(), 1, "{how:?}");
        for c in &got.chunks {
            assert_eq!(
                (c["id"].as_str(), c["created"].as_u64()),
                (Some("chatcmpl-1"), Some(1))
            );
        }
        g.stop().await;
    }
}

/// The terminal error event of a broken stream, and whether it says a continuation failed.
fn terminal(payloads: &[String]) -> Option<String> {
    let r = read(payloads);
    (r.errors == 1 && r.done).then(|| {
        payloads
            .iter()
            .find(|p| p.contains("\"error\""))
            .cloned()
            .unwrap_or_default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_cannot_be_continued_keep_the_terminal_error() {
    let (_a, _b, g) = cut_and_healthy(4, "cut-refused", "").await;
    let with = |k: &str, v: Value| {
        let mut body = chat(30);
        body[k] = v;
        body
    };
    for body in [
        with("n", json!(2)),
        with("logprobs", json!(true)),
        with("response_format", json!({"type": "json_object"})),
        with("guided_regex", json!("[a-z ]+")),
    ] {
        let got = stream_from(&g, "/v1/chat/completions", &body, "cut-refused").await;
        let err = terminal(&got).unwrap_or_else(|| panic!("no terminal error: {got:?}"));
        assert!(err.contains("backend_stream_interrupted"), "{err}");
        assert!(!err.contains("continuing"), "{err}");
    }
    let metrics = g.metrics_text().await;
    assert_eq!(
        metric(
            &metrics,
            "sluice_stream_continuations_total{backend=\"cut-refused\""
        ),
        0.0
    );
    g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuation_off_keeps_the_terminal_error() {
    let (_a, _b, g) = cut_and_healthy(4, "cut-off", "continue_streams = false\n").await;
    let got = stream_from(&g, "/v1/chat/completions", &chat(30), "cut-off").await;
    assert!(terminal(&got).is_some(), "{got:?}");
    g.stop().await;
    assert!(sluice::config::from_str("[routing]\ncontinue_streams = \"yes\"\n", "t").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_that_fails_ends_with_the_terminal_error() {
    // Both backends cut every stream: the continuation breaks too (no second continuation).
    let (a, b) = (cutting_sim(4).await, cutting_sim(4).await);
    let g = gateway(
        &[("cut-failed", "vllm", a.url()), ("b", "vllm", b.url())],
        "",
    )
    .await;
    let got = stream_from(&g, "/v1/chat/completions", &chat(30), "cut-failed").await;
    assert!(terminal(&got).is_some(), "{got:?}");
    assert!(
        read(&got).text.len() > 4,
        "the continuation's text went out before it broke"
    );
    g.stop().await;
    // The only other backend is overloaded: the continuation gets its 503.
    let (a, o) = (cutting_sim(4).await, sim(SimKind::Vllm, &[MODEL]).await);
    o.set_fault(Fault::mode(FaultMode::Overloaded)).unwrap();
    let g = gateway(
        &[("cut-failed", "vllm", a.url()), ("o", "vllm", o.url())],
        "",
    )
    .await;
    let got = stream_from(&g, "/v1/chat/completions", &chat(30), "cut-failed").await;
    let err = terminal(&got).unwrap_or_else(|| panic!("{got:?}"));
    assert!(
        err.contains("continuing it on another backend failed"),
        "{err}"
    );
    let metrics = g.metrics_text().await;
    assert_eq!(
        metric(
            &metrics,
            "sluice_stream_continuations_total{backend=\"cut-failed\",outcome=\"failed\"}"
        ),
        1.0
    );
    g.stop().await;
    // The only other backend cannot continue (a generic OpenAI server): no continuation is
    // tried, and an engine's error event reaches the client as it did without continuation.
    let raw = bad_backend(Misbehaviour::SseErrorEvent).await;
    let o = sim(SimKind::Vllm, &[MODEL]).await;
    let g = gateway(&[("err-alone", "vllm", raw), ("o", "openai", o.url())], "").await;
    let got = stream_from(&g, "/v1/chat/completions", &chat(30), "err-alone").await;
    let err = terminal(&got).unwrap_or_else(|| panic!("{got:?}"));
    assert!(err.contains("EngineCore encountered an issue"), "{err}");
    let metrics = g.metrics_text().await;
    assert_eq!(
        metric(
            &metrics,
            "sluice_stream_continuations_total{backend=\"err-alone\""
        ),
        0.0
    );
    g.stop().await;
    // An engine's error event whose continuation fails: the client gets that event after all.
    let raw = bad_backend(Misbehaviour::SseErrorEvent).await;
    let o = sim(SimKind::Vllm, &[MODEL]).await;
    o.set_fault(Fault::mode(FaultMode::Overloaded)).unwrap();
    let g = gateway(&[("err-held", "vllm", raw), ("o", "vllm", o.url())], "").await;
    let got = stream_from(&g, "/v1/chat/completions", &chat(30), "err-held").await;
    let err = terminal(&got).unwrap_or_else(|| panic!("{got:?}"));
    assert!(err.contains("EngineCore encountered an issue"), "{err}");
    assert_eq!(read(&got).text, "HiHi");
    let metrics = g.metrics_text().await;
    let failed = "sluice_stream_continuations_total{backend=\"err-held\",outcome=\"failed\"}";
    assert_eq!(metric(&metrics, failed), 1.0);
    g.stop().await;
}

/// The OpenAI Python SDK reads a continued stream as one answer, without an error; a
/// structured-output stream, which cannot be continued, raises `openai.APIError` where it breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_reads_a_continued_stream() {
    let Some(python) = process::python_with(&["openai"]) else {
        return;
    };
    let (_a, b, g) = cut_and_healthy(5, "cut-sdk", "").await;
    let want = read(&reference(&b.url(), "/v1/chat/completions", &chat(40)).await);
    sdk_reads_the_continuation(
        python,
        "gateway_resume_sdk.py",
        &g,
        "/v1",
        want.text,
        "cut-sdk",
        vec![("SLUICE_CUT_BACKEND", "cut-sdk".to_string())],
    )
    .await;
    g.stop().await;
}

/// The vLLM sim renders `continue_final_message` / `add_generation_prompt` as vLLM does: both
/// at once is its validator's 400; a continued assistant message goes on where it stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vllm_sim_continues_a_final_message_as_vllm_does() {
    let s = sim(SimKind::Vllm, &[MODEL]).await;
    let c = client();
    let url = s.url() + "/v1/chat/completions";
    let mut body = json!({"model": MODEL, "max_tokens": 30, "seed": 4,
        "messages": [{"role": "user", "content": "Tell me"}]});
    let whole = support::request::post_for_json(&c, &url, &body).await;
    let text = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let partial: String = text.split_inclusive(' ').take(4).collect();
    let partial = partial.trim_end().to_string();
    body["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": partial}));
    body["continue_final_message"] = json!(true);
    for both in [json!(true), Value::Null] {
        body["add_generation_prompt"] = both.clone();
        if both.is_null() {
            body.as_object_mut()
                .unwrap()
                .remove("add_generation_prompt");
        }
        let r = post_json(&c, &url, &body).await;
        assert_eq!(r.status(), 400, "add_generation_prompt {both}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("Cannot set both `continue_final_message`")),
            "{v}"
        );
    }
    body["add_generation_prompt"] = json!(false);
    let rest = support::request::post_for_json(&c, &url, &body).await;
    let rest_text = rest["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(format!("{partial}{rest_text}"), text);
    assert_eq!(
        rest["usage"]["completion_tokens"].as_u64().unwrap() + 3,
        whole["usage"]["completion_tokens"].as_u64().unwrap()
    );
    // Without a generation prompt and without continuing, the model gets the plain turns.
    body["continue_final_message"] = json!(false);
    let plain = support::request::post_for_json(&c, &url, &body).await;
    assert_eq!(plain["object"], "chat.completion", "{plain}");
}

/// The events of a Messages stream: (event name, data as JSON).
fn messages_events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_string(), serde_json::from_str(data).unwrap()))
        })
        .collect()
}

/// A Messages stream cut mid-answer continues through the engine's chat completions endpoint
/// and reads as the uncut answer's events: same message, one text block, the text, the stop
/// reason and usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_stream_continues_as_the_same_message() {
    let (_a, b, g) = cut_and_healthy(7, "cut-msg", "").await;
    let body = json!({"model": MODEL, "max_tokens": 40, "stream": true, "system": "Be brief.",
        "messages": [{"role": "user", "content": "Tell me about the sea."}]});
    let want = post_json(&client(), b.url() + "/v1/messages", &body).await;
    let want = messages_events(&want.text().await.unwrap());
    let c = client();
    let mut got = None;
    for _ in 0..4 {
        let r = post_json(&c, g.url("/v1/messages"), &body).await;
        assert_eq!(r.status(), 200);
        let on = header(&r, "x-sluice-backend").to_string();
        let text = r.text().await.unwrap();
        if on == "cut-msg" {
            got = Some(messages_events(&text));
            break;
        }
    }
    let got = got.expect("a stream on cut-msg");
    let names = |e: &[(String, Value)]| e.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&got), names(&want), "{got:?}");
    let text = |e: &[(String, Value)]| {
        e.iter()
            .filter_map(|(_, v)| v["delta"]["text"].as_str())
            .collect::<String>()
    };
    assert_eq!(text(&got), text(&want));
    let last = |e: &[(String, Value)], name: &str| {
        e.iter().rev().find(|(n, _)| n == name).unwrap().1.clone()
    };
    assert_eq!(last(&got, "message_delta"), last(&want, "message_delta"));
    assert_eq!(
        last(&got, "message_start")["message"]["id"],
        got[0].1["message"]["id"]
    );
    let metrics = g.metrics_text().await;
    let continued = "sluice_stream_continuations_total{backend=\"cut-msg\",outcome=\"continued\"}";
    assert_eq!(metric(&metrics, continued), 1.0, "{metrics}");
    g.stop().await;
}

/// The Anthropic Python SDK reads a continued Messages stream as one message, without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_sdk_reads_a_continued_messages_stream() {
    let Some(python) = process::python_with(&["anthropic"]) else {
        return;
    };
    let (_a, b, g) = cut_and_healthy(8, "cut-msg-sdk", "").await;
    let body = json!({"model": MODEL, "max_tokens": 40, "system": "Be brief.",
        "messages": [{"role": "user", "content": "Tell me about the sea."}]});
    let want = support::request::post_for_json(&client(), b.url() + "/v1/messages", &body).await;
    let want = want["content"][0]["text"].as_str().unwrap().to_string();
    sdk_reads_the_continuation(
        python,
        "gateway_resume_anthropic_sdk.py",
        &g,
        "",
        want,
        "cut-msg-sdk",
        vec![],
    )
    .await;
    g.stop().await;
}

/// A text request of the Responses API, streamed.
fn responses(max_output_tokens: u32) -> Value {
    json!({"model": MODEL, "stream": true, "max_output_tokens": max_output_tokens,
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Tell me about the sea."}]}]})
}

/// Post a Responses `body` until the stream starts on `first`; its events.
async fn responses_from(g: &TestGateway, body: &Value, first: &str) -> Vec<(String, Value)> {
    let c = client();
    for _ in 0..4 {
        let r = post_json(&c, g.url("/v1/responses"), body).await;
        assert_eq!(r.status(), 200);
        let on = header(&r, "x-sluice-backend").to_string();
        let text = r.text().await.unwrap();
        if on == first {
            return messages_events(&text);
        }
    }
    panic!("no stream started on {first}");
}

/// The text of a Responses stream's deltas.
fn responses_text(events: &[(String, Value)]) -> String {
    events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .filter_map(|(_, v)| v["delta"].as_str())
        .collect()
}

/// A Responses stream cut mid-answer continues through the engine's chat completions endpoint
/// and reads as the uncut answer's events: one response (its id, creation time and model on
/// the final object), one message item whose deltas carry on, sequence numbers without a gap,
/// the closing events with the whole text, and the answer's usage, counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_stream_continues_as_the_same_response() {
    let (_a, b, g) = cut_and_healthy(7, "cut-resp", "[admin]\nlisten = \"127.0.0.1:0\"\n").await;
    let mut produced = (0, 0);
    for max in [60, 12] {
        let body = responses(max);
        let want = post_json(&client(), b.url() + "/v1/responses", &body).await;
        let want = messages_events(&want.text().await.unwrap());
        let got = responses_from(&g, &body, "cut-resp").await;
        let names = |e: &[(String, Value)]| e.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want), "{got:?}");
        assert!(
            names(&got)
                .iter()
                .filter(|n| *n == "response.output_text.delta")
                .count()
                > 3,
            "the answer is longer than the cut"
        );
        assert_eq!(responses_text(&got), responses_text(&want), "max {max}");
        for (i, (n, v)) in got.iter().enumerate() {
            assert_eq!(v["type"], n.as_str());
            assert_eq!(
                v["sequence_number"], i as u64,
                "{n}: numbered without a gap"
            );
        }
        let item = got[2].1["item"]["id"].clone();
        for (n, v) in got.iter().filter(|(_, v)| v.get("item_id").is_some()) {
            assert_eq!(v["item_id"], item, "{n}");
        }
        let (start, end) = (&got[0].1["response"], &got.last().unwrap().1["response"]);
        let want_end = &want.last().unwrap().1["response"];
        for k in ["id", "created_at", "model"] {
            assert_eq!(end[k], start[k], "{k}");
        }
        assert!(start["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(end["model"], MODEL);
        for k in [
            "status",
            "incomplete_details",
            "instructions",
            "max_output_tokens",
        ] {
            assert_eq!(end[k], want_end[k], "{k}");
        }
        assert_eq!(end["output"][0]["id"], item);
        assert_eq!(
            end["output"][0]["content"][0]["text"].as_str(),
            Some(responses_text(&want).as_str())
        );
        let last = |name: &str| got.iter().rev().find(|(n, _)| n == name).unwrap().1.clone();
        assert_eq!(
            last("response.output_text.done")["text"],
            end["output"][0]["content"][0]["text"]
        );
        let (u, w) = (&end["usage"], &want_end["usage"]);
        assert_eq!(u["output_tokens"], w["output_tokens"], "{u} vs {w}");
        let (gi, wi) = (
            u["input_tokens"].as_u64().unwrap(),
            w["input_tokens"].as_u64().unwrap(),
        );
        assert!(gi == wi || gi + 1 == wi, "input {gi} vs {wi}");
        assert_eq!(
            u["total_tokens"].as_u64(),
            Some(gi + u["output_tokens"].as_u64().unwrap())
        );
        produced.0 += gi;
        produced.1 += u["output_tokens"].as_u64().unwrap();
    }
    // Two answers, each counted once with the usage the client read.
    let c = client();
    eventually(Duration::from_secs(3), "usage counted once", || {
        let (c, url) = (c.clone(), g.admin_url("/admin/usage"));
        async move {
            let v = get_json(&c, url).await;
            let rows = v["rows"].as_array().cloned().unwrap_or_default();
            let sum = |k: &str| rows.iter().filter_map(|r| r[k].as_u64()).sum::<u64>();
            let requests = v["tenants"].as_object().map(|t| {
                t.values()
                    .filter_map(|t| t["requests"].as_u64())
                    .sum::<u64>()
            });
            requests == Some(2)
                && sum("prompt_tokens") == produced.0
                && sum("completion_tokens") == produced.1
        }
    })
    .await;
    let metrics = g.metrics_text().await;
    let continued = "sluice_stream_continuations_total{backend=\"cut-resp\",outcome=\"continued\"}";
    assert_eq!(metric(&metrics, continued), 2.0, "{metrics}");
    g.stop().await;
}

/// Responses requests a continuation cannot answer faithfully keep the terminal error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_that_cannot_be_continued_keep_the_terminal_error() {
    let (_a, _b, g) = cut_and_healthy(6, "cut-resp-refused", "").await;
    let with = |k: &str, v: Value| {
        let mut body = responses(40);
        body[k] = v;
        body
    };
    for body in [
        with("store", json!(true)),
        with(
            "tools",
            json!([{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
        ),
        with("text", json!({"format": {"type": "json_object"}})),
        with("top_logprobs", json!(2)),
    ] {
        let got = responses_from(&g, &body, "cut-resp-refused").await;
        let (name, err) = got.last().unwrap_or_else(|| panic!("{body}: nothing"));
        assert_eq!(name, "error", "{body}: {got:?}");
        assert_eq!(err["error"]["code"], "backend_stream_interrupted", "{err}");
        assert!(
            !responses_text(&got).is_empty(),
            "{body}: the text before the cut went out"
        );
        assert!(
            !got.iter().any(|(n, _)| n == "response.completed"),
            "{got:?}"
        );
    }
    let metrics = g.metrics_text().await;
    assert_eq!(
        metric(
            &metrics,
            "sluice_stream_continuations_total{backend=\"cut-resp-refused\""
        ),
        0.0
    );
    g.stop().await;
}

/// The OpenAI Python SDK reads a continued Responses stream as one response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_reads_a_continued_responses_stream() {
    let Some(python) = process::python_with(&["openai"]) else {
        return;
    };
    let (_a, b, g) = cut_and_healthy(8, "cut-resp-sdk", "").await;
    let mut body = responses(40);
    body["stream"] = json!(false);
    let want = support::request::post_for_json(&client(), b.url() + "/v1/responses", &body).await;
    let want = want["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    sdk_reads_the_continuation(
        python,
        "gateway_resume_responses_sdk.py",
        &g,
        "/v1",
        want,
        "cut-resp-sdk",
        vec![],
    )
    .await;
    g.stop().await;
}

/// TGI and Ollama continue a Responses answer too (the chat form of each, as for chat): the
/// client reads one response whose text is the part that went out and that engine's rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_and_ollama_continue_a_responses_answer() {
    for (kind, name, label) in [
        (SimKind::Tgi, "tgi", "cut-resp-to-tgi"),
        (SimKind::Ollama, "ollama", "cut-resp-to-ollama"),
    ] {
        let a = cutting_sim(8).await;
        let other = sim(kind, &[MODEL]).await;
        let g = gateway(&[(label, "vllm", a.url()), ("o", name, other.url())], "").await;
        let got = responses_from(&g, &responses(40), label).await;
        assert!(!got.iter().any(|(n, _)| n == "error"), "{label}: {got:?}");
        for (i, (n, v)) in got.iter().enumerate() {
            assert_eq!(v["sequence_number"], i as u64, "{label}: {n}");
        }
        let end = &got.last().unwrap().1;
        assert_eq!(end["type"], "response.completed", "{label}");
        let r = &end["response"];
        assert_eq!(r["id"], got[0].1["response"]["id"], "{label}");
        let text = responses_text(&got);
        assert!(text.split_whitespace().count() > 4, "{label}: {text}");
        assert_eq!(
            r["output"][0]["content"][0]["text"].as_str(),
            Some(text.as_str())
        );
        assert_eq!(
            r["usage"]["output_tokens"].as_u64(),
            Some(text.split_whitespace().count() as u64),
            "{label}: {r}"
        );
        let metrics = g.metrics_text().await;
        let continued = format!(
            "sluice_stream_continuations_total{{backend=\"{label}\",outcome=\"continued\"}}"
        );
        assert_eq!(metric(&metrics, &continued), 1.0, "{label}");
        g.stop().await;
    }
}

/// A continued response is stored nowhere: with the store on, its id (naming the backend whose
/// stream broke, which stored nothing of an aborted generation) is unknown to a later `GET`,
/// and a request asking for `store: true` is not continued at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_response_is_stored_nowhere() {
    let store_sim = || {
        sim_with(
            sluice::sim::SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
                .speed(0.0)
                .responses_store(true),
        )
    };
    let (a, b) = (store_sim().await, store_sim().await);
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = 7;
    a.set_fault(fault).unwrap();
    let g = gateway(
        &[("cut-stored", "vllm", a.url()), ("b", "vllm", b.url())],
        "",
    )
    .await;
    let got = responses_from(&g, &responses(40), "cut-stored").await;
    assert_eq!(got.last().unwrap().0, "response.completed", "{got:?}");
    let id = got[0].1["response"]["id"].as_str().unwrap().to_string();
    let r = client()
        .get(g.url(&format!("/v1/responses/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "response_not_found", "{v}");
    let mut stored = responses(40);
    stored["store"] = json!(true);
    let got = responses_from(&g, &stored, "cut-stored").await;
    assert_eq!(got.last().unwrap().0, "error", "{got:?}");
    g.stop().await;
}
