//! The TGI personality against protocols.md §3 (field by field, framing byte by byte).

use crate::support::sim::*;
use serde_json::{json, Value};
use sluice::sim::SimKind;

#[tokio::test]
async fn health_info_models() {
    let sim = start(SimKind::Tgi, &["bigscience/bloom-560m"], |c| c.speed(0.0)).await;
    let c = client();
    let r = c.get(format!("{}/health", sim.url())).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "");
    let info: Value = get_json(&c, format!("{}/info", sim.url())).await;
    assert_eq!(
        keys(&info.to_string()).len(),
        14,
        "model_id … docker_label: {info}"
    );
    assert_eq!(info["model_id"], "bigscience/bloom-560m");
    assert_eq!(info["max_concurrent_requests"], 128);
    assert_eq!(info["max_total_tokens"], 8192);
    assert_eq!(info["max_input_tokens"], 8191);
    assert_eq!(info["router"], "text-generation-router");
    assert_eq!(info["version"], "3.3.6-dev0");
    let m: Value = get_json(&c, format!("{}/v1/models", sim.url())).await;
    assert_eq!(
        m,
        json!({"object":"list","data":[{"id":"bigscience/bloom-560m","object":"model","created":0,"owned_by":"bigscience/bloom-560m"}]})
    );
}

#[tokio::test]
async fn generate_and_details() {
    let sim = start(SimKind::Tgi, &["m"], |c| c.speed(0.0)).await;
    let c = client();
    let r = post_json(
        &c,
        format!("{}/generate", sim.url()),
        &json!({"inputs":"Hello","parameters":{"max_new_tokens":5,"details":true,"seed":42}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-generated-tokens"], "5");
    assert!(r.headers().contains_key("x-prompt-tokens"));
    assert!(r.headers().contains_key("x-compute-type"));
    assert!(r.headers().contains_key("x-total-time"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["details"]["finish_reason"], "length");
    assert_eq!(v["details"]["generated_tokens"], 5);
    assert_eq!(v["details"]["seed"], 42);
    assert_eq!(v["details"]["tokens"].as_array().unwrap().len(), 5);
    let text: String = v["details"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(v["generated_text"], text.as_str());
    // no details: just the text; POST / wraps it in an array
    let v: Value = post_for_json(
        &c,
        format!("{}/", sim.url()),
        &json!({"inputs":"Hello","parameters":{"max_new_tokens":3}}),
    )
    .await;
    assert!(v.as_array().unwrap()[0]["generated_text"].is_string());
    assert!(v[0].get("details").is_none());
}

#[tokio::test]
async fn generate_stream_framing_has_no_space_and_no_done() {
    let sim = start(SimKind::Tgi, &["m"], |c| c.speed(0.0)).await;
    let r = post_json(
        &client(),
        format!("{}/generate_stream", sim.url()),
        &json!({"inputs":"Hello","parameters":{"max_new_tokens":3}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert_eq!(r.headers()["x-accel-buffering"], "no");
    let raw = r.text().await.unwrap();
    assert!(!raw.contains("[DONE]"));
    let ev = sse_payloads(&raw, "data:");
    assert_eq!(ev.len(), 3);
    assert!(!ev[0].starts_with(' '));
    for (i, e) in ev.iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["index"], i as u64 + 1);
        assert_eq!(
            keys(&v["token"].to_string()),
            ["id", "logprob", "special", "text"]
        );
        if i < 2 {
            assert_eq!(
                keys(e),
                [
                    "index",
                    "token",
                    "id",
                    "text",
                    "logprob",
                    "special",
                    "generated_text",
                    "details"
                ]
            );
            assert_eq!(v["generated_text"], Value::Null);
        } else {
            let d = &v["details"];
            assert_eq!(d["finish_reason"], "length");
            assert_eq!(d["generated_tokens"], 3);
            assert!(d["input_length"].as_u64().unwrap() > 0);
            assert_eq!(keys(&d.to_string()).len(), 4);
        }
    }
}

#[tokio::test]
async fn chat_quirks_empty_id_model_echo_done_without_space() {
    let sim = start(SimKind::Tgi, &["m"], |c| c.speed(0.0)).await;
    let c = client();
    let v: Value = post_for_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"model":"whatever-you-say","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":4}),
    )
    .await;
    assert_eq!(v["id"], "");
    assert_eq!(v["model"], "whatever-you-say");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["system_fingerprint"], "3.3.6-dev0-native");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let v: Value = post_for_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"model":"tgi","messages":[{"role":"user","content":"hi"}],"max_tokens":2}),
    )
    .await;
    assert_eq!(v["model"], "m");
    let raw = post_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}),
    )
    .await
        .text()
        .await
        .unwrap();
    let ev = sse_payloads(&raw, "data:");
    assert_eq!(ev.last().unwrap(), "[DONE]");
    assert!(raw.ends_with("data:[DONE]\n\n"));
    assert_eq!(ev.len(), 3 + 1 + 1);
    for e in &ev[..3] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["id"], "");
        assert_eq!(v["usage"], Value::Null);
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
    }
    let u: Value = serde_json::from_str(&ev[3]).unwrap();
    assert_eq!(u["choices"], json!([]));
    assert_eq!(u["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn overload_429_and_in_stream_error() {
    let sim = start(SimKind::Tgi, &["m"], |c| {
        c.speed(1.0)
            .max_concurrent_requests(1)
            .output_tokens(200, 200)
    })
    .await;
    let c = client();
    // hold the only permit with a long stream
    let hold = post_json(
        &c,
        format!("{}/generate_stream", sim.url()),
        &json!({"inputs":"long","parameters":{"max_new_tokens":200}}),
    )
    .await;
    assert_eq!(hold.status(), 200);
    let r = post_json(
        &c,
        format!("{}/generate", sim.url()),
        &json!({"inputs":"x"}),
    )
    .await;
    assert_eq!(r.status(), 429);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"Model is overloaded","error_type":"overloaded"}"#
    );
    let r = post_json(
        &c,
        format!("{}/generate_stream", sim.url()),
        &json!({"inputs":"x"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.text().await.unwrap(),
        "data:{\"error\":\"Model is overloaded\",\"error_type\":\"overloaded\"}\n\n"
    );
    let r = post_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"messages":[{"role":"user","content":"x"}],"stream":true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.text().await.unwrap(),
        "data:{\"error\":{\"message\":\"Model is overloaded\",\"http_status_code\":422}}\n\ndata:[DONE]\n\n"
    );
    let m = get_text(&c, format!("{}/metrics", sim.url())).await;
    assert!(
        m.contains("tgi_request_failure{err=\"overloaded\"} 3"),
        "{m}"
    );
    assert!(m.contains("tgi_batch_current_size 1"), "{m}");
    for name in [
        "tgi_queue_size",
        "tgi_batch_current_max_tokens",
        "tgi_request_duration_bucket",
        "tgi_request_count",
    ] {
        assert!(m.contains(name), "{name}");
    }
    drop(hold);
}

#[tokio::test]
async fn validation_and_bad_json() {
    let sim = start(SimKind::Tgi, &["m"], |c| c.speed(0.0).max_model_len(100)).await;
    let c = client();
    let r = post_json(
        &c,
        format!("{}/generate", sim.url()),
        &json!({"inputs":"x","parameters":{"max_new_tokens":200}}),
    )
    .await;
    assert_eq!(r.status(), 422);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error_type"], "validation");
    assert!(v["error"]
        .as_str()
        .unwrap()
        .starts_with("`inputs` tokens + `max_new_tokens` must be <= 100."));
    let r = post_json(
        &c,
        format!("{}/generate", sim.url()),
        &json!({"inputs":"x","parameters":{"max_new_tokens":0}}),
    )
    .await;
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"],
        "`max_new_tokens` must be strictly positive"
    );
    let r = c
        .post(format!("{}/generate", sim.url()))
        .header("content-type", "application/json")
        .body("{bad")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r
        .text()
        .await
        .unwrap()
        .starts_with("Failed to parse the request body as JSON"));
    let r = c
        .post(format!("{}/generate", sim.url()))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let t: Value = post_for_json(
        &c,
        format!("{}/tokenize", sim.url()),
        &json!({"inputs":"Hello world"}),
    )
    .await;
    assert_eq!(t.as_array().unwrap().len(), 4);
    assert_eq!(keys(&t[0].to_string()), ["id", "start", "stop", "text"]);
}
