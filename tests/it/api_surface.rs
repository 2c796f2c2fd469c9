//! The engines' wider surface through the gateway: `/tokenize`, `/detokenize`,
//! `/v1/chat/completions/batch` (vLLM sims), `/v1/models` with context lengths, the pooling
//! paths and the multipart audio paths (scripted backends: no simulator serves them) — each
//! with auth, allow-lists, limits, failover and the `endpoint` label like chat.

use crate::support;

use serde_json::{json, Value};
use sluice::sim::SimKind;
use support::{backend, client, get_text, metric, TestGateway};

fn key_block(name: &str, tenant: &str, extra: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    (
        key,
        format!(
            "\n[[keys]]\nname = \"{name}\"\ntenant = \"{tenant}\"\nhash = \"{hash}\"\n{extra}\n"
        ),
    )
}

/// What a vLLM backend is asked besides requests: load signals and where its KV events are.
const PROBES: &[&str] = &["/metrics", "/load", "/version", "/kv_event_sources"];

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
    assert!((3..=12).contains(&c), "completion tokens {c}");

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerank_and_score_go_to_the_backends_of_the_pooling_model() {
    let json_ct = vec![("content-type", "application/json".to_string())];
    // A vLLM sim serving the cross-encoder under its own name: it answers 404 to any other
    // name, so a 200 also says the backend got its name for the model.
    let pool = support::sim(SimKind::Vllm, &["rr-backend"]).await;
    let chat = support::ScriptedBackend::start(200, json_ct, "{}".into()).await;
    let tgi = support::sim(SimKind::Tgi, &["surf-rr-tgi"]).await;
    let (key, block) = key_block(
        "surf-rr",
        "surf-rr",
        "models = [\"surf-rr\", \"surf-rr-tgi\"]",
    );
    let gw = TestGateway::start_healthy(&format!(
        "{}model_names = {{ \"surf-rr\" = \"rr-backend\" }}\n{}{}{block}",
        backend("surf-rr-pool", "vllm", &pool.url(), &["surf-rr"]),
        backend("surf-rr-chat", "openai", &chat.url(), &["surf-other"]),
        backend("surf-rr-t", "tgi", &tgi.url(), &["surf-rr-tgi"]),
    ))
    .await;
    let body = json!({"model": "surf-rr", "query": "q", "documents": ["a", "b", "c"], "top_n": 2});
    let mut first = None;
    for path in ["/v1/rerank", "/rerank"] {
        let (s, v) = post(&gw, &key, path, body.clone()).await;
        assert_eq!(s, 200, "{path}: {v}");
        // The client's model name comes back; best first, cut to top_n, the same each time.
        assert_eq!(v["model"], "surf-rr", "{path}");
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), 2, "{v}");
        assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
        assert!(v["usage"]["prompt_tokens"].as_u64() > Some(0), "{v}");
        let order: Vec<Value> = results.iter().map(|r| r["index"].clone()).collect();
        assert_eq!(first.get_or_insert(order.clone()), &order);
    }
    let score = json!({"model": "surf-rr", "text_1": "q", "text_2": ["a", "b"]});
    let (s, v) = post(&gw, &key, "/v1/score", score).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["model"].as_str(), v["object"].as_str()),
        (Some("surf-rr"), Some("list"))
    );
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2), "{v}");
    assert!(
        chat.inference_requests()
            .into_iter()
            .filter(|s| !PROBES.contains(&s.path.as_str()))
            .collect::<Vec<_>>()
            .is_empty(),
        "only the model's backends are candidates"
    );

    // No TGI serves rerank; a model outside the key's allow-list is refused before routing.
    let (s, _) = post(
        &gw,
        &key,
        "/v1/rerank",
        json!({"model": "surf-rr-tgi", "query": "q", "documents": []}),
    )
    .await;
    assert_eq!(s, 404);
    let (s, v) = post(
        &gw,
        &key,
        "/v1/score",
        json!({"model": "surf-other", "text_1": "a", "text_2": "b"}),
    )
    .await;
    assert!(s == 403 || s == 404, "{s} {v}");
    assert!(chat
        .inference_requests()
        .into_iter()
        .filter(|s| !PROBES.contains(&s.path.as_str()))
        .collect::<Vec<_>>()
        .is_empty());
    // Anything else under /v1/ is still an OpenAI 404.
    let (s, v) = post(&gw, &key, "/v1/classify", body).await;
    assert_eq!(
        (s, v["error"]["type"].as_str()),
        (404, Some("invalid_request_error")),
        "{v}"
    );

    let m = gw.metrics_text().await;
    for (endpoint, n) in [("rerank", 2.0), ("score", 1.0)] {
        let series = format!(
            "sluice_requests_total{{endpoint=\"{endpoint}\",model=\"surf-rr\",tenant=\"surf-rr\",backend=\"surf-rr-pool\",status=\"2xx\"}}"
        );
        assert_eq!(metric(&m, &series), n, "{series}\n{m}");
    }
}

/// A multipart body: an audio file part (with bytes that look like fields), then `model`.
fn audio_form(boundary: &str, model: &str) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
    b.extend_from_slice(b"RIFF\x00\x01\xff name=\"model\"\r\n\r\nnot-this\x00");
    b.extend_from_slice(format!("\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"response_format\"\r\n\r\ntext\r\n--{boundary}--\r\n").as_bytes());
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audio_forms_are_routed_by_their_model_field_and_forwarded_byte_for_byte() {
    // A vLLM sim serving a speech model: its answer is a function of the uploaded file's
    // bytes, and it reads the form by the boundary of the content type.
    let whisper = support::sim(SimKind::Vllm, &["surf-whisper"]).await;
    let other = support::sim(SimKind::Vllm, &["surf-chat"]).await;
    let (key, block) = key_block("surf-au", "surf-au", "requests_per_minute = 2");
    let gw = TestGateway::start_healthy(&format!(
        "{}{}\n[server]\nmax_body_bytes = 4096\n{block}",
        backend("surf-au-w", "vllm", &whisper.url(), &["surf-whisper"]),
        backend("surf-au-c", "vllm", &other.url(), &["surf-chat"]),
    ))
    .await;
    let send = |path: &'static str, ct: String, body: Vec<u8>| {
        let (url, key) = (gw.url(path), key.clone());
        async move {
            let r = client()
                .post(url)
                .bearer_auth(key)
                .header("content-type", ct)
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let ct = "multipart/form-data; boundary=surfB0undary".to_string();
    let form = audio_form("surfB0undary", "surf-whisper");
    // What the engine answers this very form directly.
    let direct = client()
        .post(format!("{}/v1/audio/transcriptions", whisper.url()))
        .header("content-type", ct.clone())
        .body(form.clone())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(direct.ends_with('\n') && direct.len() > 2, "{direct}");
    let (s, t) = send("/v1/audio/transcriptions", ct.clone(), form.clone()).await;
    assert_eq!(
        (s, t.as_str()),
        (200, direct.as_str()),
        "the same bytes reached it"
    );
    let (s, t) = send("/v1/audio/translations", ct.clone(), form.clone()).await;
    assert_eq!((s, t.as_str()), (200, direct.as_str()));

    // The third request of the minute is over the key's limit, as for chat.
    let (s, _) = send("/v1/audio/transcriptions", ct.clone(), form.clone()).await;
    assert_eq!(s, 429);

    let m = gw.metrics_text().await;
    let series = "sluice_requests_total{endpoint=\"audio_transcriptions\",model=\"surf-whisper\",tenant=\"surf-au\",backend=\"surf-au-w\",status=\"2xx\"}";
    assert_eq!(metric(&m, series), 1.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audio_forms_that_cannot_be_routed_are_refused_before_any_backend() {
    let whisper = support::ScriptedBackend::start(200, vec![], "x".into()).await;
    let gw = TestGateway::start_healthy(&format!(
        "{}\n[server]\nmax_body_bytes = 4096\n",
        backend("surf-au2-w", "vllm", &whisper.url(), &["surf-whisper2"]),
    ))
    .await;
    let send = |ct: &'static str, body: Vec<u8>| {
        let url = gw.url("/v1/audio/transcriptions");
        async move {
            let r = client()
                .post(url)
                .header("content-type", ct)
                .body(body)
                .send()
                .await
                .unwrap();
            let s = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            (s, v)
        }
    };
    let ct = "multipart/form-data; boundary=zz";
    // JSON is not a form.
    let (s, v) = send(
        "application/json",
        b"{\"model\":\"surf-whisper2\"}".to_vec(),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (415, Some("unsupported_media_type")),
        "{v}"
    );
    // A form without a model, a form that is not one, an unknown model.
    let no_model =
        b"--zz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--zz--\r\n".to_vec();
    let (s, v) = send(ct, no_model).await;
    assert_eq!(
        (s, v["error"]["param"].as_str()),
        (400, Some("model")),
        "{v}"
    );
    assert_eq!(send(ct, b"garbage".to_vec()).await.0, 400);
    let (s, v) = send(ct, audio_form("zz", "nope")).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    // Larger than the body cap: 413 without reading it all.
    let mut big = audio_form("zz", "surf-whisper2");
    big.splice(0..0, std::iter::repeat_n(b'a', 5000));
    assert_eq!(send(ct, big).await.0, 413);
    assert!(whisper
        .inference_requests()
        .into_iter()
        .filter(|s| !PROBES.contains(&s.path.as_str()))
        .collect::<Vec<_>>()
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_the_status_page_count_each_endpoint() {
    let vllm = support::sim(SimKind::Vllm, &["surf-sum"]).await;
    let gw = TestGateway::start_healthy(&backend("surf-sum-v", "vllm", &vllm.url(), &["surf-sum"]))
        .await;
    let conv = json!([{"role": "user", "content": "hello"}]);
    let batch = json!({"model": "surf-sum", "max_tokens": 3, "messages": [conv, conv]});
    assert_eq!(
        post(&gw, "", "/v1/chat/completions/batch", batch).await.0,
        200
    );
    assert_eq!(
        post(
            &gw,
            "",
            "/tokenize",
            json!({"model": "surf-sum", "prompt": "a"})
        )
        .await
        .0,
        200
    );
    assert_eq!(
        post(
            &gw,
            "",
            "/tokenize",
            json!({"model": "nope", "prompt": "a"})
        )
        .await
        .0,
        404
    );
    let chat = support::chat_body("surf-sum", false, 3);
    assert_eq!(post(&gw, "", "/v1/chat/completions", chat).await.0, 200);

    let m = gw.metrics_text().await;
    let tokens = |kind: &str, endpoint: &str| {
        metric(&m, &format!("sluice_{kind}_tokens_total{{model=\"surf-sum\",tenant=\"anonymous\",endpoint=\"{endpoint}\"}}"))
    };
    assert!(
        tokens("prompt", "chat_batch") > 0.0 && tokens("completion", "chat_batch") > 0.0,
        "{m}"
    );
    assert!(tokens("prompt", "chat") > 0.0, "{m}");

    let s: Value = client()
        .get(gw.url("/admin/summary"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let rows = s["endpoints"].as_array().unwrap();
    let row = |e: &str| {
        rows.iter()
            .find(|r| r["endpoint"] == e)
            .cloned()
            .unwrap_or_else(|| panic!("{e} in {s}"))
    };
    // The recorder is shared by the tests of this process: other tests' rows only add.
    assert!(row("tokenize")["requests"].as_f64().unwrap() >= 2.0);
    assert!(row("tokenize")["errors"].as_f64().unwrap() >= 1.0);
    assert!(row("chat_batch")["completion_tokens"].as_f64().unwrap() > 0.0);
    assert!(row("chat")["requests"].as_f64().unwrap() >= 1.0);
    let page = get_text(&client(), gw.url("/dashboard")).await;
    assert!(page.contains("id=\"endpoints\""));
}
