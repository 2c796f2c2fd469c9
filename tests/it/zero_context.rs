//! Context length as a routing input (issue 18 item 4): each backend's context window is
//! learned and shown in `/admin/backends`; a request too long for one backend goes to one with
//! room; one that fits nowhere gets vLLM's 400 at once. The simulators enforce context limits
//! as their engines do, and the vLLM simulator honours `ignore_eos`.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice::sim::{SimConfig, SimKind};
use support::*;

fn vllm(model: &str, len: u32) -> SimConfig {
    SimConfig::new(SimKind::Vllm, vec![model.into()])
        .speed(0.0)
        .max_model_len(len)
}

/// A chat whose one message is about `tokens` tokens long (the simulators count 4 bytes a
/// token, as the gateway's estimate does).
fn long_chat(model: &str, tokens: usize, max_tokens: u64) -> Value {
    json!({
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "abcd".repeat(tokens)}]
    })
}

/// Until `/admin/backends` shows `backend`'s context window for `model`.
async fn until_learned(g: &TestGateway, backend: &str, model: &str) -> u64 {
    let g = &g;
    poll(
        Duration::from_secs(10),
        "context length learned",
        || async move {
            let v = g.admin_backends().await;
            let b = v["backends"]
                .as_array()?
                .iter()
                .find(|b| b["name"] == backend)?
                .clone();
            b["context_lengths"][model].as_u64()
        },
    )
    .await
}

async fn small_and_big() -> (sluice::sim::SimHandle, sluice::sim::SimHandle, TestGateway) {
    let small = sim_with(vllm("ctxm", 2048)).await;
    let big = sim_with(vllm("ctxm", 16384)).await;
    let g = TestGateway::start_healthy(&format!(
        "[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n{FAST_HEALTH}{}{}",
        backend("ctx-small", "vllm", &small.url(), &["ctxm"]),
        backend("ctx-big", "vllm", &big.url(), &["ctxm"]),
    ))
    .await;
    assert_eq!(until_learned(&g, "ctx-small", "ctxm").await, 2048);
    assert_eq!(until_learned(&g, "ctx-big", "ctxm").await, 16384);
    (small, big, g)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_too_long_for_one_backend_goes_to_the_one_with_room() {
    let (_small, _big, g) = small_and_big().await;
    let c = client();
    let url = g.url("/v1/chat/completions");
    // Short requests go to both (round robin).
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let r = post_json(&c, url.clone(), &chat_body("ctxm", false, 8)).await;
        assert!(r.status().is_success());
        seen.insert(header(&r, "x-sluice-backend").to_string());
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    // ~4000 prompt tokens: only the big one has room, every time.
    let before = g.attempts("ctx-small");
    for _ in 0..4 {
        let r = post_json(&c, url.clone(), &long_chat("ctxm", 4000, 100)).await;
        let status = r.status();
        let backend = header(&r, "x-sluice-backend").to_string();
        let v: Value = r.json().await.unwrap();
        assert!(status.is_success(), "{v}");
        assert_eq!(backend, "ctx-big");
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 2048, "{v}");
    }
    // A short prompt whose max_tokens does not fit the small one goes big too.
    let r = post_json(&c, url.clone(), &chat_body("ctxm", false, 3000)).await;
    assert!(r.status().is_success());
    assert_eq!(header(&r, "x-sluice-backend"), "ctx-big");
    assert_eq!(
        g.attempts("ctx-small"),
        before,
        "the small backend was sent a long request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_fits_nowhere_gets_the_engines_400_at_once() {
    let (_small, _big, g) = small_and_big().await;
    let c = client();
    let sent = g.attempts("ctx-small") + g.attempts("ctx-big");
    // A prompt beyond every window.
    let t = Instant::now();
    let r = post_json(
        &c,
        g.url("/v1/chat/completions"),
        &long_chat("ctxm", 40_000, 10),
    )
    .await;
    let took = t.elapsed();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(took < Duration::from_millis(500), "{took:?}");
    // vLLM's own answer, as the gateway passes an engine's 400 on.
    assert_eq!(v["error"]["code"], "400", "{v}");
    assert_eq!(v["error"]["type"], "BadRequestError", "{v}");
    assert!(v["error"]["param"].is_null(), "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    let want =
        "This model's maximum context length is 16384 tokens. However, your request has about";
    assert!(msg.starts_with(want), "{msg}");
    // A short prompt asking for more output than any window holds.
    let r = post_json(
        &c,
        g.url("/v1/chat/completions"),
        &chat_body("ctxm", true, 50_000),
    )
    .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    let want = "max_tokens=50000 cannot be greater than max_model_len=16384.";
    assert!(msg.starts_with(want), "{msg}");
    // Completions: the same answer for a prompt string.
    let body = json!({"model": "ctxm", "prompt": "abcd".repeat(40_000), "max_tokens": 5});
    let r = post_json(&c, g.url("/v1/completions"), &body).await;
    assert_eq!(r.status(), 400);
    // The Messages API shapes it its own way.
    let body = json!({
        "model": "ctxm", "max_tokens": 10,
        "messages": [{"role": "user", "content": "abcd".repeat(40_000)}]
    });
    let r = post_json(&c, g.url("/v1/messages"), &body).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    // No backend was sent any of these.
    assert_eq!(g.attempts("ctx-small") + g.attempts("ctx-big"), sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_and_ollama_windows_are_learned() {
    let tgi = sim_with(
        SimConfig::new(SimKind::Tgi, vec!["ctx-tgi-m".into()])
            .speed(0.0)
            .max_model_len(3000),
    )
    .await;
    let ollama = sim_with(
        SimConfig::new(SimKind::Ollama, vec!["ctx-oll-m".into()])
            .speed(0.0)
            .max_model_len(2048)
            .preloaded(true),
    )
    .await;
    let g = TestGateway::start_healthy(&format!(
        "{FAST_HEALTH}{}{}",
        backend("ctx-tgi", "tgi", &tgi.url(), &["ctx-tgi-m"]),
        backend("ctx-oll", "ollama", &ollama.url(), &["ctx-oll-m"]),
    ))
    .await;
    assert_eq!(until_learned(&g, "ctx-tgi", "ctx-tgi-m").await, 3000);
    assert_eq!(until_learned(&g, "ctx-oll", "ctx-oll-m:latest").await, 2048);
    // Beyond TGI's window (more than twice, so the estimate cannot be that wrong): refused
    // unsent, in vLLM's words.
    let r = g.chat(&long_chat("ctx-tgi-m", 7000, 10)).await;
    assert_eq!(r.status(), 400);
    // Beyond Ollama's window: Ollama truncates, so it is sent and answered.
    let r = g.chat(&long_chat("ctx-oll-m", 5000, 10)).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() < 2048, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulators_enforce_their_engines_context_limits() {
    let c = client();
    // vLLM: 400 before any work.
    let v = sim_with(vllm("ctx-sim", 1024)).await;
    let r = post_json(
        &c,
        format!("{}/v1/chat/completions", v.url()),
        &long_chat("ctx-sim", 2000, 5),
    )
    .await;
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 1024"),
        "{body}"
    );
    // TGI: 422 validation.
    let t = sim_with(
        SimConfig::new(SimKind::Tgi, vec!["ctx-sim".into()])
            .speed(0.0)
            .max_model_len(1024),
    )
    .await;
    let body = json!({"inputs": "abcd".repeat(2000), "parameters": {"max_new_tokens": 5}});
    let r = post_json(&c, format!("{}/generate", t.url()), &body).await;
    assert_eq!(r.status(), 422);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error_type"], "validation", "{body}");
    // Ollama: an 800k-token prompt is truncated to the window (keeping num_keep tokens and the
    // end) and answered at once, at realistic speed, instead of being prefilled whole.
    let o = sim_with(
        SimConfig::new(SimKind::Ollama, vec!["ctx-sim".into()])
            .max_model_len(2048)
            .preloaded(true),
    )
    .await;
    let body = json!({
        "model": "ctx-sim", "stream": false, "options": {"num_predict": 4},
        "messages": [{"role": "user", "content": "abcd".repeat(800_000)}]
    });
    let started = Instant::now();
    let r = post_json(&c, format!("{}/api/chat", o.url()), &body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // num_ctx 2048, num_keep 4: 2048 - (2048 - 4) / 2 tokens are read.
    assert_eq!(v["prompt_eval_count"], 1026, "{v}");
    // A prompt that fits is read whole; num_keep -1 keeps as much of the start as fits.
    let body = json!({"model": "ctx-sim", "stream": false, "prompt": "abcd".repeat(100), "options": {"num_predict": 2}});
    let v: Value = post_json(&c, format!("{}/api/generate", o.url()), &body)
        .await
        .json()
        .await
        .unwrap();
    assert!(v["prompt_eval_count"].as_u64().unwrap() >= 100, "{v}");
    let body = json!({"model": "ctx-sim", "stream": false, "prompt": "abcd".repeat(5000), "options": {"num_predict": 2, "num_keep": -1}});
    let v: Value = post_json(&c, format!("{}/api/generate", o.url()), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["prompt_eval_count"], 2047, "{v}");
}

/// `ignore_eos` also holds when the prompt ends with the start of its own answer (an open
/// assistant message, or a completions prompt with the text so far): the answer goes on where
/// it stands and runs to `max_tokens`, as a real vLLM does, not to the simulator's natural
/// length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_answer_with_ignore_eos_runs_to_max_tokens() {
    let s = sim_with(vllm("ctx-cont", 8192).output_tokens(3, 5)).await;
    let c = client();
    let chat_url = format!("{}/v1/chat/completions", s.url());
    // an answer far past the model's natural 3-5 tokens
    let mut body = json!({"model": "ctx-cont", "max_tokens": 40, "ignore_eos": true, "seed": 9,
        "messages": [{"role": "user", "content": "Tell me"}]});
    let whole = support::request::post_for_json(&c, &chat_url, &body).await;
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(whole["usage"]["completion_tokens"], 40, "{whole}");
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    let partial = words[..21].concat().trim_end().to_string();
    let expected_next: String = words[21..].concat();
    body["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": partial}));
    body["continue_final_message"] = json!(true);
    body["add_generation_prompt"] = json!(false);
    body["max_tokens"] = json!(30);
    for stream in [false, true] {
        body["stream"] = json!(stream);
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = post_json(&c, &chat_url, &body).await;
        let (tokens, rest, finish) = if stream {
            let events = sse_data(&r.text().await.unwrap());
            let chunks: Vec<Value> = events
                .iter()
                .filter_map(|e| serde_json::from_str(e).ok())
                .collect();
            let rest: String = chunks
                .iter()
                .filter_map(|v| v["choices"][0]["delta"]["content"].as_str())
                .collect();
            let finish = chunks
                .iter()
                .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(String::from));
            let usage = chunks.iter().find(|v| v["usage"].is_object()).unwrap();
            (usage["usage"]["completion_tokens"].clone(), rest, finish)
        } else {
            let v: Value = r.json().await.unwrap();
            let rest = v["choices"][0]["message"]["content"].as_str().unwrap();
            let finish = v["choices"][0]["finish_reason"].as_str().map(String::from);
            (
                v["usage"]["completion_tokens"].clone(),
                rest.to_string(),
                finish,
            )
        };
        assert_eq!(tokens, 30, "stream {stream}: {rest:?}");
        assert_eq!(finish.as_deref(), Some("length"));
        // it continues the same answer: the words after the given ones come first
        assert!(
            rest.trim_start().starts_with(&expected_next),
            "stream {stream}: {rest:?}"
        );
    }
    // completions: the prompt with the text so far appended
    let done = json!({"model": "ctx-cont", "prompt": "Once", "max_tokens": 40, "ignore_eos": true});
    let url = format!("{}/v1/completions", s.url());
    let first = support::request::post_for_json(&c, &url, &done).await;
    let text = first["choices"][0]["text"].as_str().unwrap();
    let cut: String = text.split_inclusive(' ').take(30).collect();
    let cut = cut.trim_end();
    let more = json!({"model": "ctx-cont", "prompt": format!("Once{cut}"), "max_tokens": 25,
        "ignore_eos": true});
    let v = support::request::post_for_json(&c, &url, &more).await;
    assert_eq!(v["usage"]["completion_tokens"], 25, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(
        text[cut.len()..].starts_with(v["choices"][0]["text"].as_str().unwrap().get(..10).unwrap())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_vllm_simulator_honours_ignore_eos() {
    let s = sim_with(vllm("ctx-eos", 8192).output_tokens(3, 5)).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", s.url());
    // Without it the answer stops early, by its end of text.
    let v: Value = post_json(&c, url.clone(), &chat_body("ctx-eos", false, 300))
        .await
        .json()
        .await
        .unwrap();
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 5,
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // With it, exactly max_tokens, ended by length — streamed too.
    let mut body = chat_body("ctx-eos", false, 300);
    body["ignore_eos"] = json!(true);
    let v: Value = post_json(&c, url.clone(), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 300, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let text = post_json(&c, url.clone(), &body)
        .await
        .text()
        .await
        .unwrap();
    let events = sse_data(&text);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 300, "{text}");
    let finishes = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|e| e["choices"][0]["finish_reason"].is_string())
        .count();
    assert_eq!(finishes, 1);
    // Completions too.
    let body = json!({"model": "ctx-eos", "prompt": "hi", "max_tokens": 50, "ignore_eos": true});
    let v: Value = post_json(&c, format!("{}/v1/completions", s.url()), &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 50, "{v}");
    // A malformed value is vLLM's 400.
    let mut body = chat_body("ctx-eos", false, 5);
    body["ignore_eos"] = json!("yes");
    let r = post_json(&c, url, &body).await;
    assert_eq!(r.status(), 400);
}
