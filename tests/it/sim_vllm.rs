//! The vLLM personality against the captures of a real vLLM 0.32 server (tests/fixtures).

use crate::support::sim::*;
use serde_json::{json, Value};
use sluice::sim::SimKind;

#[tokio::test]
async fn health_version_and_headers() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let c = client();
    let r = c.get(format!("{}/health", sim.url())).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["server"], "uvicorn");
    assert_eq!(r.headers()["vary"], "Origin");
    assert_eq!(r.headers()["content-length"], "0");
    assert!(r.headers().get("content-type").is_none());
    assert_eq!(r.text().await.unwrap(), "");
    let r = c.get(format!("{}/ping", sim.url())).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(format!("{}/version", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(r.text().await.unwrap(), fixture_body("version.http"));
}

#[tokio::test]
async fn models_match_the_capture_shape() {
    let sim = start(SimKind::Vllm, &["tiny", "alias"], |c| {
        c.speed(0.0).max_model_len(1024)
    })
    .await;
    let body = get_text(&client(), format!("{}/v1/models", sim.url())).await;
    let cap = fixture_body("models.http");
    let k = keys(&body);
    let one = keys(&cap);
    // two served names: the capture's entry shape twice
    let entry: Vec<String> = one[2..].to_vec();
    let mut expected = one[..2].to_vec();
    expected.extend(entry.clone());
    expected.extend(entry);
    assert_eq!(k, expected);
    let v: Value = serde_json::from_str(&body).unwrap();
    let m = &v["data"][0];
    assert_eq!(m["id"], "tiny");
    assert_eq!(v["data"][1]["id"], "alias");
    assert_eq!(m["object"], "model");
    assert_eq!(m["owned_by"], "vllm");
    assert_eq!(m["max_model_len"], 1024);
    assert_eq!(m["parent"], Value::Null);
    assert!(m["root"].is_string());
    let p = &m["permission"][0];
    assert_eq!(p["object"], "model_permission");
    assert!(p["id"].as_str().unwrap().starts_with("modelperm-"));
    assert_eq!(p["organization"], "*");
    assert_eq!(p["allow_sampling"], true);
    assert_eq!(p["is_blocking"], false);
}

#[tokio::test]
async fn chat_non_stream_matches_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let r = post_json(
        &client(),
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"model":"tiny","messages":[{"role":"user","content":"Hello there"}],"max_tokens":8}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(r.headers()["server"], "uvicorn");
    let body = r.text().await.unwrap();
    assert_eq!(keys(&body), keys(&fixture_body("chat.http")));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    assert_eq!(v["system_fingerprint"], "vllm-0.32.0-ed4dc49f");
    let ch = &v["choices"][0];
    assert_eq!(ch["finish_reason"], "length");
    assert_eq!(ch["stop_reason"], Value::Null);
    assert_eq!(ch["message"]["role"], "assistant");
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], 8);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + 8
    );
    // usage is consistent with the documented tokenizer: each generated word is one token
    let content = ch["message"]["content"].as_str().unwrap();
    assert_eq!(content.split(' ').filter(|w| !w.is_empty()).count(), 8);
}

#[tokio::test]
async fn completions_match_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let body = post_json(
        &client(),
        format!("{}/v1/completions", sim.url()),
        &json!({"model":"tiny","prompt":"Hi","max_tokens":5}),
    )
    .await
    .text()
    .await
    .unwrap();
    assert_eq!(keys(&body), keys(&fixture_body("completions.http")));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

async fn stream_raw(url: &str, body: Value) -> (reqwest::header::HeaderMap, String) {
    let r = post_json(&client(), format!("{url}/v1/chat/completions"), &body).await;
    assert_eq!(r.status(), 200);
    let h = r.headers().clone();
    (h, r.text().await.unwrap())
}

#[tokio::test]
async fn chat_stream_framing_matches_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let (h, raw) = stream_raw(
        &sim.url(),
        json!({"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}),
    )
    .await;
    assert_eq!(h["content-type"], "text/event-stream; charset=utf-8");
    assert_eq!(h["transfer-encoding"], "chunked");
    assert_eq!(h["server"], "uvicorn");
    let got = sse_payloads(&raw, "data: ");
    let cap = sse_payloads(&fixture_body("chat-stream.http"), "data: ");
    assert_eq!(got.len(), cap.len(), "{raw}");
    assert_eq!(got.last().unwrap(), "[DONE]");
    for (g, c) in got.iter().zip(&cap) {
        assert_eq!(keys(g), keys(c), "chunk shape: {g}");
    }
    let first: Value = serde_json::from_str(&got[0]).unwrap();
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role":"assistant","content":""})
    );
    let id = first["id"].as_str().unwrap().to_string();
    for g in &got[1..got.len() - 1] {
        let v: Value = serde_json::from_str(g).unwrap();
        assert_eq!(v["id"], id.as_str());
        assert!(v.get("usage").is_none());
    }
    let last: Value = serde_json::from_str(&got[got.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["system_fingerprint"], "vllm-0.32.0-ed4dc49f");
}

#[tokio::test]
async fn chat_stream_usage_chunk_matches_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let (_, raw) = stream_raw(
        &sim.url(),
        json!({"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":6,"stream":true,"stream_options":{"include_usage":true}}),
    )
    .await;
    let got = sse_payloads(&raw, "data: ");
    let cap = sse_payloads(&fixture_body("chat-stream-usage.http"), "data: ");
    assert_eq!(got.len(), cap.len());
    for (g, c) in got.iter().zip(&cap) {
        assert_eq!(keys(g), keys(c), "chunk shape: {g}");
    }
    let usage: Value = serde_json::from_str(&got[got.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    // stream_options: {} turns usage on in vLLM
    let (_, raw) = stream_raw(
        &sim.url(),
        json!({"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,"stream_options":{}}),
    )
    .await;
    assert!(raw.contains("\"choices\":[],\"usage\""));
}

#[tokio::test]
async fn errors_match_the_capture_bytes() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(0.0).max_model_len(1024)
    })
    .await;
    let c = client();
    let post = |body: &'static str| {
        let c = c.clone();
        let url = format!("{}/v1/chat/completions", sim.url());
        async move {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (s, b) = post("{bad json}").await;
    assert_eq!((s, b), (400, fixture_body("error-bad-json.http")));
    let (s, b) = post(r#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#).await;
    assert_eq!((s, b), (404, fixture_body("error-unknown-model.http")));
    let (s, b) =
        post(r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"max_tokens":5000}"#)
            .await;
    assert_eq!((s, b), (400, fixture_body("error-max-tokens.http")));
    let (s, b) = post(r#"{"model":"tiny"}"#).await;
    assert_eq!((s, b), (400, fixture_body("error-missing-messages.http")));
}

#[tokio::test]
async fn unknown_model_lists_every_alias() {
    let sim = start(SimKind::Vllm, &["a", "b"], |c| c.speed(0.0)).await;
    let r = post_json(
        &client(),
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"model":"x","messages":[]}),
    )
    .await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"error":{"message":"The model `x` does not exist. Valid aliases: a, b.","type":"NotFoundError","param":"model","code":404}})
    );
}

#[tokio::test]
async fn metrics_use_vllm_names_help_and_labels() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let c = client();
    c.post(format!("{}/v1/chat/completions", sim.url()))
        .json(&json!({"messages":[{"role":"user","content":"hi"}],"max_tokens":3}))
        .send()
        .await
        .unwrap();
    let r = c
        .get(format!("{}/metrics", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers()["content-type"],
        "text/plain; version=1.0.0; charset=utf-8"
    );
    let text = r.text().await.unwrap();
    let cap = fixture_body("metrics-idle.http");
    for line in text
        .lines()
        .filter(|l| l.starts_with("# HELP") || l.starts_with("# TYPE"))
    {
        if !line.contains("cache_config_info") {
            assert!(
                cap.lines().any(|c| c == line),
                "HELP/TYPE line not in the capture: {line}"
            );
        }
    }
    for name in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 0.0",
        "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.0",
        "vllm:num_preemptions_total{engine=\"0\",model_name=\"tiny\"} 0.0",
        "vllm:generation_tokens_total{engine=\"0\",model_name=\"tiny\"} 3.0",
        "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"tiny\"}",
        "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"tiny\"} 0.0",
        "vllm:prompt_tokens_total{engine=\"0\",model_name=\"tiny\"}",
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",model_name=\"tiny\"} 1.0",
        "vllm:e2e_request_latency_seconds_count{engine=\"0\",model_name=\"tiny\"} 1.0",
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"tiny\"} 1.0",
    ] {
        assert!(text.lines().any(|l| l.starts_with(name)), "missing {name}\n{text}");
    }
}

#[tokio::test]
async fn same_seed_same_text() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let c = client();
    let ask = |seed: i64| {
        let c = c.clone();
        let url = format!("{}/v1/chat/completions", sim.url());
        async move {
            let v: Value = post_for_json(
                &c,
                url,
                &json!({"messages":[{"role":"user","content":"same"}],"max_tokens":20,"seed":seed}),
            )
            .await;
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    assert_eq!(ask(1).await, ask(1).await);
    assert_ne!(ask(1).await, ask(2).await);
}

#[tokio::test]
async fn tokenize_agrees_with_usage() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(0.0).max_model_len(1024)
    })
    .await;
    let c = client();
    let msgs = json!([{"role":"user","content":"How many tokens is this prompt?"}]);
    let t: Value = post_for_json(
        &c,
        format!("{}/tokenize", sim.url()),
        &json!({"model":"tiny","messages":msgs}),
    )
    .await;
    assert_eq!(keys(&t.to_string()).len(), 4);
    assert_eq!(t["max_model_len"], 1024);
    assert_eq!(t["token_strs"], Value::Null);
    let n = t["count"].as_u64().unwrap();
    assert_eq!(t["tokens"].as_array().unwrap().len() as u64, n);
    let v: Value = post_for_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"model":"tiny","messages":msgs,"max_tokens":1}),
    )
    .await;
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap(), n);
    let d: Value = post_for_json(
        &c,
        format!("{}/detokenize", sim.url()),
        &json!({"tokens":[1000, 1001]}),
    )
    .await;
    assert_eq!(d, json!({"prompt":" the a"}));
}

#[tokio::test]
async fn embeddings_have_the_openai_shape() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let v: Value = post_for_json(
        &client(),
        format!("{}/v1/embeddings", sim.url()),
        &json!({"model":"tiny","input":["a b","c"]}),
    )
    .await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["data"][1]["index"], 1);
    assert_eq!(v["data"][0]["object"], "embedding");
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 384);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
}
