//! The Ollama personality against protocols.md §4.

use std::time::{Duration, Instant};

use crate::support::poll;
use crate::support::sim::*;
use serde_json::{json, Value};
use sluice::sim::SimKind;

#[tokio::test]
async fn root_version_tags_show_and_no_metrics() {
    let sim = start(SimKind::Ollama, &["llama3.2", "qwen:0.5b"], |c| {
        c.speed(0.0)
    })
    .await;
    let c = client();
    let r = c.get(format!("{}/", sim.url())).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "Ollama is running");
    let v: Value = get_json(&c, format!("{}/api/version", sim.url())).await;
    assert!(v["version"].is_string());
    let t: Value = get_json(&c, format!("{}/api/tags", sim.url())).await;
    let names: Vec<&str> = t["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["llama3.2:latest", "qwen:0.5b"]);
    let m = &t["models"][0];
    assert_eq!(m["model"], "llama3.2:latest");
    assert_eq!(m["digest"].as_str().unwrap().len(), 64);
    assert_eq!(m["details"]["format"], "gguf");
    assert!(m["modified_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(get_status(&c, format!("{}/metrics", sim.url())).await, 404);
    let s: Value = post_for_json(
        &c,
        format!("{}/api/show", sim.url()),
        &json!({"model":"llama3.2"}),
    )
    .await;
    assert_eq!(s["model_info"]["llama.context_length"], 4096);
    let r = post_json(
        &c,
        format!("{}/api/show", sim.url()),
        &json!({"model":"nope"}),
    )
    .await;
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn native_chat_streams_ndjson_by_default() {
    let sim = start(SimKind::Ollama, &["llama3.2"], |c| c.speed(0.0)).await;
    let r = post_json(
        &client(),
        format!("{}/api/chat", sim.url()),
        &json!({"model":"llama3.2","messages":[{"role":"user","content":"hi"}],"options":{"num_predict":4}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    let raw = r.text().await.unwrap();
    assert!(raw.ends_with("}\n"));
    let lines: Vec<Value> = raw
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for l in &lines[..4] {
        assert_eq!(keys(&l.to_string()).len(), 6);
        assert_eq!(l["done"], false);
        assert_eq!(l["model"], "llama3.2");
        assert_eq!(l["message"]["role"], "assistant");
    }
    let last = &lines[4];
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 4);
    assert!(last["prompt_eval_count"].as_u64().unwrap() > 0);
    assert!(last["total_duration"].as_u64().unwrap() > 0);
    assert!(last["load_duration"].as_u64().unwrap() > 0);
    assert_eq!(last["message"]["content"], "");
    // the raw key order of the final object follows Go's struct order
    let k = keys(raw.lines().last().unwrap());
    assert_eq!(
        &k[..6],
        [
            "model",
            "created_at",
            "message",
            "role",
            "content",
            "done_reason"
        ]
    );
    assert_eq!(k[6], "done");
}

#[tokio::test]
async fn native_generate_non_stream_and_errors() {
    let sim = start(SimKind::Ollama, &["llama3.2"], |c| c.speed(0.0)).await;
    let c = client();
    let v: Value = post_for_json(
        &c,
        format!("{}/api/generate", sim.url()),
        &json!({"model":"llama3.2:latest","prompt":"hi","stream":false,"options":{"num_predict":3}}),
    )
    .await;
    assert_eq!(v["done"], true);
    assert_eq!(v["eval_count"], 3);
    assert!(v["context"].is_array());
    assert_eq!(
        v["response"].as_str().unwrap().split_whitespace().count(),
        3
    );
    let r = post_json(
        &c,
        format!("{}/api/chat", sim.url()),
        &json!({"model":"foo","messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"model 'foo' not found"}"#
    );
    let r = post_json(
        &c,
        format!("{}/api/chat", sim.url()),
        &json!({"messages":[]}),
    )
    .await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.text().await.unwrap(), r#"{"error":"model is required"}"#);
    let r = c
        .post(format!("{}/api/generate", sim.url()))
        .body("")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"missing request body"}"#
    );
    // empty request: load only
    let v: Value = post_for_json(
        &c,
        format!("{}/api/generate", sim.url()),
        &json!({"model":"llama3.2"}),
    )
    .await;
    assert_eq!(v["done_reason"], "load");
    let e: Value = post_for_json(
        &c,
        format!("{}/api/embed", sim.url()),
        &json!({"model":"llama3.2","input":["a","b"]}),
    )
    .await;
    assert_eq!(e["embeddings"].as_array().unwrap().len(), 2);
    assert!(e["prompt_eval_count"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn openai_surface_quirks() {
    let sim = start(SimKind::Ollama, &["llama3.2"], |c| c.speed(0.0)).await;
    let c = client();
    let v: Value = post_for_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"model":"llama3.2","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"max_completion_tokens":1}),
    )
    .await;
    let id = v["id"].as_str().unwrap();
    let n: u32 = id.strip_prefix("chatcmpl-").unwrap().parse().unwrap();
    assert!(n < 999);
    assert_eq!(v["system_fingerprint"], "fp_ollama");
    assert_eq!(v["model"], "llama3.2");
    // max_completion_tokens is ignored; max_tokens is honoured
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let raw = post_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"model":"llama3.2","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}),
    )
    .await
        .text()
        .await
        .unwrap();
    let ev = sse_payloads(&raw, "data: ");
    // 2 tokens, the finish chunk, the usage chunk, [DONE]
    assert_eq!(ev.len(), 5);
    let fin: Value = serde_json::from_str(&ev[2]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    assert_eq!(fin["choices"][0]["delta"]["content"], "");
    let u: Value = serde_json::from_str(&ev[3]).unwrap();
    assert_eq!(u["choices"], json!([]));
    assert_eq!(
        u["usage"]["total_tokens"].as_u64().unwrap(),
        u["usage"]["prompt_tokens"].as_u64().unwrap() + 2
    );
    assert!(serde_json::from_str::<Value>(&ev[0])
        .unwrap()
        .get("usage")
        .is_none());
    let m: Value = get_json(&c, format!("{}/v1/models", sim.url())).await;
    assert_eq!(m["data"][0]["id"], "llama3.2:latest");
    assert_eq!(m["data"][0]["owned_by"], "library");
    assert_eq!(
        get_status(&c, format!("{}/v1/models/llama3.2", sim.url())).await,
        200
    );
    let r = c
        .get(format!("{}/v1/models/nope", sim.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "not_found_error"
    );
    let e: Value = post_for_json(
        &c,
        format!("{}/v1/embeddings", sim.url()),
        &json!({"model":"llama3.2","input":"x"}),
    )
    .await;
    assert_eq!(e["data"][0]["object"], "embedding");
}

#[tokio::test]
async fn residency_load_time_and_ps() {
    let sim = start(SimKind::Ollama, &["a", "b"], |c| {
        c.speed(1.0)
            .load_time(Duration::from_millis(300))
            .keep_alive(Duration::from_secs(60))
            .timing(sluice::sim::Timing {
                decode_base: Duration::from_micros(100),
                ..Default::default()
            })
    })
    .await;
    let c = client();
    let ps: Value = get_json(&c, format!("{}/api/ps", sim.url())).await;
    assert_eq!(ps["models"], json!([]));
    let ask = || {
        let c = c.clone();
        let url = format!("{}/api/chat", sim.url());
        async move {
            let t = Instant::now();
            let v: Value = post_for_json(
                &c,
                url,
                &json!({"model":"a","messages":[{"role":"user","content":"x"}],"stream":false,"options":{"num_predict":2}}),
            )
            .await;
            (t.elapsed(), v["load_duration"].as_u64().unwrap())
        }
    };
    let (cold, load_cold) = ask().await;
    let (_, load_warm) = ask().await;
    assert!(load_cold >= 300_000_000, "cold load_duration {load_cold}");
    assert!(cold >= Duration::from_millis(300));
    assert!(load_warm < 100_000_000, "warm load_duration {load_warm}");
    let ps: Value = get_json(&c, format!("{}/api/ps", sim.url())).await;
    let names: Vec<&str> = ps["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a:latest"]);
    assert!(ps["models"][0]["expires_at"]
        .as_str()
        .unwrap()
        .ends_with('Z'));
    assert!(ps["models"][0]["size_vram"].as_u64().is_some());
}

#[tokio::test]
async fn busy_503_past_the_pending_queue() {
    let sim = start(SimKind::Ollama, &["a"], |c| {
        c.speed(1.0)
            .parallel(1)
            .max_queue(1)
            .preloaded(true)
            .output_tokens(500, 500)
    })
    .await;
    let c = client();
    let url = sim.url();
    let long = |c: reqwest::Client, url: String| async move {
        c.post(format!("{url}/api/chat"))
            .json(&json!({"model":"a","messages":[{"role":"user","content":"x"}]}))
            .send()
            .await
            .unwrap()
    };
    let running = long(c.clone(), url.clone()).await;
    poll(Duration::from_secs(5), "one running", || {
        let c = c.clone();
        let url = url.clone();
        async move { (state(&c, &url).await["running"] == 1).then_some(()) }
    })
    .await;
    let queued = tokio::spawn(long(c.clone(), url.clone()));
    poll(Duration::from_secs(5), "one waiting", || {
        let c = c.clone();
        let url = url.clone();
        async move { (state(&c, &url).await["waiting"] == 1).then_some(()) }
    })
    .await;
    let r = post_json(
        &c,
        format!("{url}/api/chat"),
        &json!({"model":"a","messages":[{"role":"user","content":"x"}],"stream":false}),
    )
    .await;
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"server busy, please try again.  maximum pending requests exceeded"}"#
    );
    let r = post_json(
        &c,
        format!("{url}/v1/chat/completions"),
        &json!({"model":"a","messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "api_error"
    );
    drop(running);
    queued.abort();
}
