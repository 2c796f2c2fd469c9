//! The engines' wider surface through the gateway: `/tokenize`, `/detokenize`,
//! `/v1/chat/completions/batch` (vLLM sims), `/v1/models` with context lengths, the pooling
//! paths and the multipart audio paths (scripted backends: no simulator serves them) — each
//! with auth, allow-lists, limits, failover and the `endpoint` label like chat.

use crate::support;

use serde_json::{json, Value};
use sluice::sim::SimKind;
use support::{backend, client, metric, TestGateway};

fn key_block(name: &str, tenant: &str, extra: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    (
        key,
        format!(
            "\n[[keys]]\nname = \"{name}\"\ntenant = \"{tenant}\"\nhash = \"{hash}\"\n{extra}\n"
        ),
    )
}

async fn post(gw: &TestGateway, key: &str, path: &str, body: Value) -> (u16, Value) {
    let r = client()
        .post(gw.url(path))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_are_routed_by_model_to_vllm() {
    let vllm = support::sim(SimKind::Vllm, &["surf-tok"]).await;
    let tgi = support::sim(SimKind::Tgi, &["surf-tok-tgi"]).await;
    let (key, block) = key_block("surf-tok", "surf-tok", "requests_per_minute = 1000");
    let gw = TestGateway::start_healthy(&format!(
        "{}{}{block}",
        backend("surf-tok-v", "vllm", &vllm.url(), &["surf-tok"]),
        backend("surf-tok-t", "tgi", &tgi.url(), &["surf-tok-tgi"])
    ))
    .await;

    let (s, v) = post(
        &gw,
        &key,
        "/tokenize",
        json!({"model": "surf-tok", "prompt": "hello world"}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert_eq!(v["count"].as_u64().unwrap() as usize, tokens.len());
    assert!(v["max_model_len"].as_u64().unwrap() > 0);
    let (s, v) = post(
        &gw,
        &key,
        "/detokenize",
        json!({"model": "surf-tok", "tokens": tokens}),
    )
    .await;
    assert_eq!((s, v["prompt"].as_str()), (200, Some("hello world")), "{v}");
    // Chat messages are tokenized too (the template is the backend's).
    let msgs = json!({"model": "surf-tok", "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(post(&gw, &key, "/tokenize", msgs).await.0, 200);

    // A model only a TGI serves has no backend with this path: the OpenAI 404 of an unknown model.
    let (s, v) = post(
        &gw,
        &key,
        "/tokenize",
        json!({"model": "surf-tok-tgi", "prompt": "x"}),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    // Auth and body checks as for chat.
    let (s, _) = post(
        &gw,
        "sk-wrong",
        "/tokenize",
        json!({"model": "surf-tok", "prompt": "x"}),
    )
    .await;
    assert_eq!(s, 401);
    let (s, v) = post(&gw, &key, "/detokenize", json!({"tokens": [1]})).await;
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("model")));

    let m = gw.metrics_text().await;
    for endpoint in ["tokenize", "detokenize"] {
        let series = format!(
            "sluice_requests_total{{endpoint=\"{endpoint}\",model=\"surf-tok\",tenant=\"surf-tok\",backend=\"surf-tok-v\",status=\"2xx\"}}"
        );
        assert!(metric(&m, &series) >= 1.0, "{series} in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_batch_sums_usage_and_reserves_for_every_conversation() {
    let vllm = support::sim(SimKind::Vllm, &["surf-batch"]).await;
    let (key, block) = key_block("surf-batch", "surf-batch", "tokens_per_minute = 200");
    let gw = TestGateway::start_healthy(&format!(
        "{}{block}",
        backend("surf-batch-v", "vllm", &vllm.url(), &["surf-batch"])
    ))
    .await;
    let conv = |t: &str| json!([{"role": "user", "content": t}]);
    let body = json!({"model": "surf-batch", "max_tokens": 4,
        "messages": [conv("one"), conv("two two"), conv("three three three")]});
    let (s, v) = post(&gw, &key, "/v1/chat/completions/batch", body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    let u = &v["usage"];
    let (p, c) = (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
    );
    assert_eq!(u["total_tokens"].as_u64().unwrap(), p + c);
    assert!(c <= 12 && c >= 3, "completion tokens {c}");

    // 3 × 80 output tokens cannot fit in 200 tokens a minute, though one conversation would.
    let big = json!({"model": "surf-batch", "max_tokens": 80,
        "messages": [conv("a"), conv("b"), conv("c")]});
    let (s, v) = post(&gw, &key, "/v1/chat/completions/batch", big).await;
    assert_eq!(s, 429, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("Request too large"),
        "{v}"
    );
    let one = json!({"model": "surf-batch", "max_tokens": 80, "messages": [conv("a")]});
    assert_eq!(
        post(&gw, &key, "/v1/chat/completions/batch", one).await.0,
        200
    );

    let m = gw.metrics_text().await;
    let series = "sluice_requests_total{endpoint=\"chat_batch\",model=\"surf-batch\",tenant=\"surf-batch\",backend=\"surf-batch-v\",status=\"2xx\"}";
    assert!(metric(&m, series) >= 2.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_paths_fail_over_before_the_first_byte() {
    let vllm = support::sim(SimKind::Vllm, &["surf-fo"]).await;
    let dead = format!("http://127.0.0.1:{}", support::free_port());
    let gw = TestGateway::start(&format!(
        "{}{}\n[routing]\nmax_attempts = 2\n",
        backend("surf-fo-dead", "vllm", &dead, &["surf-fo"]),
        backend("surf-fo-live", "vllm", &vllm.url(), &["surf-fo"])
    ))
    .await;
    for _ in 0..6 {
        let (s, v) = post(
            &gw,
            "",
            "/tokenize",
            json!({"model": "surf-fo", "prompt": "a b"}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_listed_once_with_the_context_length_a_backend_reports() {
    use sluice::sim::SimConfig;
    let cfg = |n: u32| {
        SimConfig::new(SimKind::Vllm, vec!["surf-ctx".into()])
            .speed(0.0)
            .max_model_len(n)
    };
    let (a, b) = (
        support::sim_with(cfg(4096)).await,
        support::sim_with(cfg(2048)).await,
    );
    let disc = support::sim_with(
        SimConfig::new(SimKind::Vllm, vec!["surf-ctx-disc".into()])
            .speed(0.0)
            .max_model_len(777),
    )
    .await;
    let tgi = support::sim(SimKind::Tgi, &["surf-ctx-tgi"]).await;
    let gw = TestGateway::start_healthy(&format!(
        "{}{}{}{}",
        backend("surf-ctx-a", "vllm", &a.url(), &["surf-ctx"]),
        backend("surf-ctx-b", "vllm", &b.url(), &["surf-ctx"]),
        backend("surf-ctx-d", "vllm", &disc.url(), &[]),
        backend("surf-ctx-t", "tgi", &tgi.url(), &["surf-ctx-tgi"]),
    ))
    .await;
    let gw = &gw;
    let list = support::poll(
        std::time::Duration::from_secs(10),
        "models listed",
        || async move {
            let v: Value = client()
                .get(gw.url("/v1/models"))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            (v["data"].as_array()?.len() == 3).then_some(v)
        },
    )
    .await;
    assert_eq!(list["object"], "list");
    let data = list["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        ["surf-ctx", "surf-ctx-disc", "surf-ctx-tgi"],
        "each once: {list}"
    );
    for m in data {
        assert_eq!(
            (m["object"].as_str(), m["owned_by"].as_str()),
            (Some("model"), Some("sluice"))
        );
        assert!(m["created"].as_u64().is_some());
    }
    // Two backends report 4096 and 2048: every one of them can take 2048.
    assert_eq!(data[0]["max_model_len"], 2048, "{list}");
    assert_eq!(data[1]["max_model_len"], 777, "{list}");
    // TGI's /info has no per-model context length in this shape: the field is left out.
    assert!(data[2].get("max_model_len").is_none(), "{list}");
    let one: Value = client()
        .get(gw.url("/v1/models/surf-ctx"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (one["id"].as_str(), one["max_model_len"].as_u64()),
        (Some("surf-ctx"), Some(2048))
    );
}
