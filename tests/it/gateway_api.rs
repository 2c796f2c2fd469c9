//! The OpenAI-compatible surface end to end: every kind of backend, stream and non-stream,
//! model aliases and per-backend names, the model list, HTTP/2, big prompts and headers.

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use sluice::sim::{SimConfig, SimKind};
use support::*;

/// A gateway whose only backend for the model is `only`, among a fleet of three kinds.
async fn single(kind: SimKind) -> (TestGateway, sluice::sim::SimHandle) {
    let (kind_str, model) = match kind {
        SimKind::Vllm => ("vllm", "llama-3.1-8b"),
        SimKind::Tgi => ("tgi", "llama-3.1-8b"),
        SimKind::Ollama => ("ollama", "llama3.1:8b"),
    };
    let s = sim(kind, &[model]).await;
    let mut t = String::from(FAST_HEALTH);
    t.push_str("\n[[models]]\nname = \"llama-3.1-8b\"\naliases = [\"llama3\"]\n");
    t.push_str(&backend("b", kind_str, &s.url(), &["llama-3.1-8b"]));
    if kind == SimKind::Ollama {
        t.push_str("model_names = { \"llama-3.1-8b\" = \"llama3.1:8b\" }\n");
    }
    (TestGateway::start_healthy(&t).await, s)
}

#[tokio::test]
async fn non_stream_chat_through_every_kind_keeps_the_clients_model_name() {
    for kind in [SimKind::Vllm, SimKind::Tgi, SimKind::Ollama] {
        let (g, _s) = single(kind).await;
        for model in ["llama-3.1-8b", "llama3"] {
            let resp = g.chat(&chat_body(model, false, 5)).await;
            assert_eq!(resp.status(), 200, "{kind:?}");
            assert!(resp.headers().get("x-request-id").is_some());
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["object"], "chat.completion", "{kind:?}: {v}");
            assert_eq!(v["model"], model, "{kind:?}: {v}");
            let id = v["id"].as_str().unwrap();
            assert!(
                id.starts_with("chatcmpl-") && id.len() > 9,
                "{kind:?}: id {id}"
            );
            assert_eq!(v["usage"]["completion_tokens"], 5, "{kind:?}: {v}");
            assert!(!v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .is_empty());
            assert_eq!(v["choices"][0]["finish_reason"], "length");
        }
        g.stop().await;
    }
}

#[tokio::test]
async fn streams_through_every_kind_chunk_by_chunk_with_done() {
    for kind in [SimKind::Vllm, SimKind::Tgi, SimKind::Ollama] {
        let (g, _s) = single(kind).await;
        let resp = g.chat(&chat_body("llama3", true, 6)).await;
        assert_eq!(resp.status(), 200);
        assert!(header(&resp, "content-type").starts_with("text/event-stream"));
        let body = resp.text().await.unwrap();
        let data = sse_data(&body);
        assert_eq!(
            data.last().map(String::as_str),
            Some("[DONE]"),
            "{kind:?}: {body}"
        );
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let mut text = String::new();
        for c in &chunks {
            assert_eq!(c["model"], "llama3", "{kind:?}: {c}");
            assert_eq!(c["object"], "chat.completion.chunk");
            assert!(
                c["id"].as_str().unwrap().starts_with("chatcmpl-"),
                "{kind:?}: {c}"
            );
            assert!(
                c.get("usage").is_none_or(|u| u.is_null()),
                "usage chunk leaked: {c}"
            );
            assert_ne!(
                c["choices"].as_array().map(|a| a.len()),
                Some(0),
                "usage-only chunk leaked: {c}"
            );
            if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
                text.push_str(t);
            }
        }
        assert!(!text.is_empty(), "{kind:?}: no text in {body}");
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length", "{kind:?}");
        g.stop().await;
    }
}

#[tokio::test]
async fn stream_usage_given_when_asked_and_counted_when_not() {
    let (g, _s) = single(SimKind::Vllm).await;
    let mut body = chat_body("llama3", true, 4);
    body["stream_options"] = json!({"include_usage": true});
    let text = g.chat(&body).await.text().await.unwrap();
    let data = sse_data(&text);
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert_eq!(usage["model"], "llama3");
    g.stop().await;
}

#[tokio::test]
async fn completions_and_embeddings() {
    let (g, _s) = single(SimKind::Vllm).await;
    let resp = post_json(
        &client(),
        g.url("/v1/completions"),
        &json!({"model": "llama3", "prompt": "Once upon a time", "max_tokens": 3}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "llama3");
    assert_eq!(v["usage"]["completion_tokens"], 3);

    let text = post_json(
        &client(),
        g.url("/v1/completions"),
        &json!({"model": "llama3", "prompt": "Once", "max_tokens": 3, "stream": true}),
    )
    .await
    .text()
    .await
    .unwrap();
    assert_eq!(sse_data(&text).last().map(String::as_str), Some("[DONE]"));

    let resp = post_json(
        &client(),
        g.url("/v1/embeddings"),
        &json!({"model": "llama-3.1-8b", "input": ["a", "b"]}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert!(v["data"][0]["embedding"].as_array().unwrap().len() > 1);
    g.stop().await;
}

#[tokio::test]
async fn models_list_is_the_union_of_healthy_backends_and_survives_one_down() {
    let a = sim(SimKind::Vllm, &["llama-3.1-8b"]).await;
    let b = sim(SimKind::Tgi, &["mistral-7b"]).await;
    let c = sim(SimKind::Ollama, &["llama3.1:8b", "qwen2.5:7b"]).await;
    let mut t = String::from(FAST_HEALTH);
    t.push_str("\n[[models]]\nname = \"llama-3.1-8b\"\naliases = [\"llama3\"]\n");
    t.push_str(&backend("gpu-a", "vllm", &a.url(), &[]));
    t.push_str(&backend("tgi-1", "tgi", &b.url(), &[]));
    t.push_str(&backend("laptop", "ollama", &c.url(), &[]));
    t.push_str("model_names = { \"llama-3.1-8b\" = \"llama3.1:8b\" }\n");
    let g = TestGateway::start(&t).await;
    let ids = || async {
        let v: Value = get_json(&client(), g.url("/v1/models")).await;
        assert_eq!(v["object"], "list");
        let mut ids: Vec<String> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                assert_eq!(m["object"], "model");
                m["id"].as_str().unwrap().to_string()
            })
            .collect();
        ids.sort();
        ids
    };
    // Discovered from each backend's own list (vLLM /v1/models, TGI /info, Ollama /api/tags).
    let want: Vec<String> = [
        "llama-3.1-8b",
        "llama3",
        "llama3.1:8b",
        "mistral-7b",
        "qwen2.5:7b",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let last = std::sync::Mutex::new(Vec::new());
    let shown = Lazy(|| format!("models: {:?}", last.lock().unwrap()));
    poll(Duration::from_secs(10), shown, || async {
        let now = ids().await;
        if now == want {
            return Some(());
        }
        *last.lock().unwrap() = now;
        None
    })
    .await;
    // One model by id, and an unknown one.
    assert_eq!(get_status(&client(), g.url("/v1/models/llama3")).await, 200);
    let resp = client().get(g.url("/v1/models/nope")).send().await.unwrap();
    assert_eq!(resp.status(), 404);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");

    // TGI goes away: its model leaves the list, the list still answers.
    b.shutdown().await;
    g.wait_state("tgi-1", "down", Duration::from_secs(5)).await;
    let got = ids().await;
    assert!(!got.contains(&"mistral-7b".to_string()), "{got:?}");
    assert!(got.contains(&"llama3".to_string()));
    g.stop().await;
}

#[tokio::test]
async fn http2_prior_knowledge() {
    let (g, _s) = single(SimKind::Vllm).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let resp = post_json(
        &h2,
        g.url("/v1/chat/completions"),
        &chat_body("llama3", true, 3),
    )
    .await;
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    assert_eq!(sse_data(&body).last().map(String::as_str), Some("[DONE]"));
    let resp = h2.get(g.url("/v1/models")).send().await.unwrap();
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    g.stop().await;
}

#[tokio::test]
async fn ten_megabyte_prompt_passes_through() {
    let s = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(0.0)
            .max_model_len(8_000_000),
    )
    .await;
    let g = TestGateway::one_backend("b", "vllm", &s.url()).await;
    let prompt = "lorem ipsum ".repeat(10 * 1024 * 1024 / 12);
    let body =
        json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]});
    let resp = g.chat(&body).await;
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    let v: Value = resp.json().await.unwrap();
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() > 1_000_000,
        "{}",
        v["usage"]
    );
    g.stop().await;
}

#[tokio::test]
async fn client_disconnect_mid_stream_cancels_upstream() {
    // 1 token per 20 ms: a 500-token answer would take 10 s.
    let s = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(1.0)).await;
    let g = TestGateway::one_backend("b", "vllm", &s.url()).await;
    let mut resp = g.chat(&chat_body("m", true, 500)).await;
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let running = |s: &sluice::sim::SimHandle| s.state()["running"].as_u64().unwrap_or(0);
    assert_eq!(running(&s), 1);
    let started = std::time::Instant::now();
    drop(resp);
    eventually(Duration::from_secs(3), "upstream cancelled", || {
        let r = running(&s);
        async move { r == 0 }
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(3));
    // The gateway's own count is released too.
    let gw = g.gw.clone();
    eventually(Duration::from_secs(2), "in-flight released", move || {
        let n = gw.runtime().fleet.backends[0].state.inflight_requests();
        async move { n == 0 }
    })
    .await;
    g.stop().await;
}
