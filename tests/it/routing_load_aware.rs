//! Load-aware routing against real simulators: token-aware learns which backend is faster
//! (nothing about speed is configured), an Ollama node with the model loaded is preferred, and
//! a TGI engine's KV budget is learned from its metrics.

use crate::support;

use std::time::Duration;

use sluice::sim::{SimConfig, SimKind, Timing};
use support::*;

fn timing(decode_base_ms: u64) -> Timing {
    Timing {
        max_num_seqs: 8,
        decode_base: Duration::from_millis(decode_base_ms),
        decode_per_seq: Duration::from_micros(100),
        prefill_per_token: Duration::from_micros(20),
        ..Timing::default()
    }
}

async fn served_by(gw: &TestGateway, body: &serde_json::Value) -> String {
    let r = gw.chat(body).await;
    assert_eq!(r.status(), 200);
    let name = header(&r, "x-sluice-backend").to_string();
    let _ = r.text().await.unwrap();
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_aware_sends_more_to_the_measured_faster_backend() {
    let fast = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(timing(2))
            .output_tokens(20, 20),
    )
    .await;
    let slow = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(timing(12))
            .output_tokens(20, 20),
    )
    .await;
    let toml = format!(
        "[routing]\npolicy = \"token-aware\"\nexpose_backend_header = true\n{FAST_HEALTH}{}{}",
        backend("slow", "vllm", &slow.url(), &["m"]),
        backend("fast", "vllm", &fast.url(), &["m"]),
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let body = chat_body("m", true, 20);
    // learn: a few requests to each (ties rotate)
    for _ in 0..6 {
        served_by(&gw, &body).await;
    }
    let mut fast_n = 0;
    let n = 24;
    for _ in 0..n {
        if served_by(&gw, &body).await == "fast" {
            fast_n += 1;
        }
    }
    assert!(fast_n * 4 >= n * 3, "fast got {fast_n} of {n}");
    let admin = gw.admin_backends().await;
    let speeds: Vec<f64> = admin["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            b["routing"]["speeds"]["decode_tokens_per_second"]
                .as_f64()
                .unwrap_or(0.0)
        })
        .collect();
    assert!(speeds.iter().any(|s| *s > 0.0), "{admin}");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_ollama_node_is_preferred_over_a_cold_one() {
    let cold = sim_with(
        SimConfig::new(SimKind::Ollama, vec!["llama3.2".into()])
            .speed(0.0)
            .preloaded(false),
    )
    .await;
    let warm = sim_with(
        SimConfig::new(SimKind::Ollama, vec!["llama3.2".into()])
            .speed(0.0)
            .preloaded(true),
    )
    .await;
    let toml = format!(
        "[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n{FAST_HEALTH}{}{}",
        backend("cold", "ollama", &cold.url(), &["llama3.2"]),
        backend("warm", "ollama", &warm.url(), &["llama3.2"]),
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let g = &gw.gw;
    eventually(Duration::from_secs(5), "both /api/ps read", || async {
        g.runtime()
            .fleet
            .backends
            .iter()
            .all(|b| b.state.signals().loaded.is_some())
    })
    .await;
    let body = chat_body("llama3.2", false, 5);
    for _ in 0..6 {
        assert_eq!(served_by(&gw, &body).await, "warm");
    }
    gw.stop().await;
}

/// Work the gateway did not send (other clients, another gateway replica) shows only in the
/// engine's own queue: token-aware reads `vllm:num_requests_waiting` and keeps new requests
/// off the backend whose queue is deep. Without that signal the two backends look identical
/// to the gateway (nothing in flight through it), so a tie-break decides; both listing orders
/// are tried, so whichever way ties break, one of them would send requests to the busy engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_aware_avoids_an_engine_with_a_deep_queue_it_did_not_cause() {
    let one_at_a_time = || Timing {
        max_num_seqs: 1,
        ..timing(20)
    };
    let busy = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(one_at_a_time())
            .output_tokens(500, 500),
    )
    .await;
    let idle = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(one_at_a_time())
            .output_tokens(500, 500),
    )
    .await;
    // Four long requests straight to the busy engine: one runs, three wait in its queue.
    let direct: Vec<_> = (0..4)
        .map(|_| {
            let url = format!("{}/v1/chat/completions", busy.url());
            tokio::spawn(async move {
                let _ = client()
                    .post(url)
                    .json(&chat_body("m", false, 500))
                    .send()
                    .await;
            })
        })
        .collect();

    let (b, i) = (
        backend("busy", "vllm", &busy.url(), &["m"]),
        backend("idle", "vllm", &idle.url(), &["m"]),
    );
    for order in [format!("{b}{i}"), format!("{i}{b}")] {
        let toml = format!(
            "[routing]\npolicy = \"token-aware\"\nexpose_backend_header = true\n{FAST_HEALTH}\
             signals_interval = \"100ms\"\n{order}"
        );
        let gw = TestGateway::start_healthy(&toml).await;
        eventually(
            Duration::from_secs(10),
            "the gateway sees the busy queue",
            || async {
                let admin = gw.admin_backends().await;
                admin["backends"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|b| b["name"] == "busy" && b["engine_waiting"].as_u64().unwrap_or(0) >= 2)
            },
        )
        .await;
        let short = chat_body("m", false, 2);
        for n in 0..8 {
            assert_eq!(served_by(&gw, &short).await, "idle", "request {n}");
        }
        gw.stop().await;
    }
    for d in direct {
        d.abort();
    }
}

/// A chat whose long system prompt the engine can cache, with a short question.
fn shared_prompt_body(model: &str, stream: bool, question: &str) -> serde_json::Value {
    let system = "You answer questions about the shared handbook. ".repeat(40);
    let mut body = serde_json::json!({
        "model": model,
        "stream": stream,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question}
        ]
    });
    if stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    body
}

/// The `usage` of a whole answer or of a stream's usage chunk.
async fn usage_of(r: reqwest::Response, stream: bool) -> serde_json::Value {
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    if !stream {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        return v["usage"].clone();
    }
    let usage = sse_data(&text)
        .into_iter()
        .filter(|d| d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(&d).ok())
        .find(|v| v["usage"].is_object())
        .unwrap_or_else(|| panic!("no usage chunk in {text}"));
    usage["usage"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_prompt_tokens_reach_the_client_unchanged() {
    let fast = || Timing {
        max_num_seqs: 8,
        decode_base: Duration::from_millis(1),
        decode_per_seq: Duration::from_micros(10),
        prefill_per_token: Duration::from_micros(1),
        ..Timing::default()
    };
    // off by default, as in vLLM: no details even on a cache hit
    let plain = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).timing(fast())).await;
    let url = format!("{}/v1/chat/completions", plain.url());
    for q in ["first?", "second?"] {
        let r = post_json(&client(), &url, &shared_prompt_body("m", false, q)).await;
        let u = usage_of(r, false).await;
        assert!(u["prompt_tokens_details"].is_null(), "{u}");
    }

    let sim = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(fast())
            .prompt_tokens_details(true),
    )
    .await;
    // the client's name differs from the backend's, so the gateway edits every event
    let toml = format!(
        "{FAST_HEALTH}\n[[backends]]\nname = \"v\"\nkind = \"vllm\"\nurl = \"{}\"\n\
         models = [\"public\"]\nmodel_names = {{ \"public\" = \"m\" }}\n",
        sim.url()
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let post = |stream: bool, q: &'static str| {
        client()
            .post(gw.url("/v1/chat/completions"))
            .json(&shared_prompt_body("public", stream, q))
            .send()
    };
    // cold: nothing cached, and vLLM 0.32 says so (0 read, the whole blocks written)
    let cold = usage_of(post(false, "one?").await.unwrap(), false).await;
    assert_eq!(cold["prompt_tokens_details"]["cached_tokens"], 0, "{cold}");
    let prompt = cold["prompt_tokens"].as_u64().unwrap();
    for stream in [false, true] {
        let u = usage_of(post(stream, "two?").await.unwrap(), stream).await;
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("stream {stream}: {u}"));
        // the system prompt's whole blocks, never the whole prompt
        assert!(
            cached >= prompt / 2 && cached < prompt,
            "{cached} of {prompt}"
        );
        assert_eq!(u["prompt_tokens"].as_u64(), Some(prompt), "{u}");
    }
    gw.stop().await;
}

/// The gateway's pending prefill at one backend: (requests, prompt tokens).
fn pending_prefill(gw: &TestGateway) -> (u64, u64) {
    let rt = gw.gw.runtime();
    let s = &rt.fleet.backends[0].state;
    (s.pending_prefill_requests(), s.pending_prefill_tokens())
}

/// Whether an SSE body so far holds a chunk with text in `content`.
fn has_text(sse: &str) -> bool {
    let key = "\"content\":\"";
    sse.match_indices(key).any(|(i, _)| {
        sse[i + key.len()..]
            .chars()
            .next()
            .is_some_and(|c| c != '"')
    })
}

fn inflight_requests(gw: &TestGateway) -> u64 {
    let rt = gw.gw.runtime();
    rt.fleet.backends[0].state.inflight_requests()
}

/// A request sent to a backend counts as pending prefill (its estimated prompt tokens) until
/// its first token streams back; then only its output is in flight until it ends. Shown in
/// `/admin/backends` and the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_is_pending_prefill_until_its_first_token() {
    // a slow prefill (about 2 s for this prompt) and a slow decode (40 tokens of 20 ms)
    let s = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(Timing {
                prefill_per_token: Duration::from_millis(4),
                ..timing(20)
            })
            .output_tokens(40, 40),
    )
    .await;
    let toml = format!(
        "[routing]\npolicy = \"token-aware\"\n{FAST_HEALTH}{}",
        // A name of its own: the gauge below is process-wide, shared with other tests' gateways.
        backend("prefill-only", "vllm", &s.url(), &["m"]),
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let body = serde_json::json!({
        "model": "m",
        "stream": true,
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "tell me about the handbook ".repeat(60)}]
    });
    let mut r = gw.chat(&body).await;
    assert_eq!(r.status(), 200);
    let admin = gw.admin_backends().await;
    let shown = &admin["backends"][0]["routing"]["gateway"];
    let metrics = gw.metrics_text().await;
    let (requests, tokens) = pending_prefill(&gw);
    // still prefilling (no chunk read yet; the prefill takes seconds)
    assert_eq!(requests, 1, "{admin}");
    assert!(tokens >= 100, "{tokens}");
    assert_eq!(shown["pending_prefill_requests"], 1, "{admin}");
    assert!(
        shown["pending_prefill_tokens"].as_u64().unwrap_or(0) >= 100,
        "{admin}"
    );
    assert!(
        admin["backends"][0]["routing"]["reference_request"]["pending_prefill_seconds"]
            .as_f64()
            .unwrap_or(0.0)
            > 0.0,
        "{admin}"
    );
    assert!(
        metrics.contains("sluice_backend_pending_prefill_tokens{backend=\"prefill-only\"}"),
        "{metrics}"
    );
    // read until the first text token
    let mut seen = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !has_text(&seen) {
        assert!(
            std::time::Instant::now() < deadline,
            "no first token: {seen}"
        );
        match r.chunk().await.unwrap() {
            Some(c) => seen.push_str(&String::from_utf8_lossy(&c)),
            None => panic!("stream ended early: {seen}"),
        }
    }
    eventually(
        Duration::from_secs(5),
        "the prefill ends at the first token",
        || async { pending_prefill(&gw) == (0, 0) },
    )
    .await;
    // the stream goes on (about 0.8 s of decode): the request is still in flight
    assert_eq!(inflight_requests(&gw), 1);
    while r.chunk().await.unwrap().is_some() {}
    eventually(
        Duration::from_secs(5),
        "the request is released",
        || async { inflight_requests(&gw) == 0 },
    )
    .await;
    assert_eq!(pending_prefill(&gw), (0, 0));
    gw.stop().await;
}

/// TGI exports no KV gauge: the gateway learns the engine's KV budget from batches that held
/// requests back, and reports the batch's share of it as KV usage, from a real TGI engine's
/// `/metrics` through the signals loop to `/admin/backends` and the gateway's own metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tgi_kv_budget_is_learned_from_batches_that_held_requests_back() {
    // Each request reserves its prompt and 1000 output tokens: two fit in 2500, a third waits.
    let tgi = sim_with(
        SimConfig::new(SimKind::Tgi, vec!["m".into()])
            .timing(Timing {
                max_num_seqs: 8,
                ..timing(20)
            })
            .kv_capacity_tokens(2500)
            .output_tokens(1000, 1000),
    )
    .await;
    let toml = format!(
        "[routing]\npolicy = \"token-aware\"\n{FAST_HEALTH}signals_interval = \"100ms\"\n{}",
        // A name of its own: the gauge below is process-wide, shared with other tests' gateways.
        backend("kv-budget-tgi", "tgi", &tgi.url(), &["m"]),
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let signals = || async {
        let admin = gw.admin_backends().await;
        admin["backends"][0]["routing"]["signals"].clone()
    };
    // Nothing has waited yet: no budget, no usage.
    let quiet = signals().await;
    assert!(quiet["learned_kv_tokens"].is_null(), "{quiet}");
    assert!(quiet["kv_cache_usage"].is_null(), "{quiet}");

    let direct: Vec<_> = (0..3)
        .map(|_| {
            let url = format!("{}/v1/chat/completions", tgi.url());
            tokio::spawn(async move {
                let _ = client()
                    .post(url)
                    .json(&chat_body("m", false, 1000))
                    .send()
                    .await;
            })
        })
        .collect();
    eventually(
        Duration::from_secs(10),
        "the budget learned from two running while one waits",
        || async {
            let s = signals().await;
            s["waiting"].as_f64() == Some(1.0)
                && s["learned_kv_tokens"].as_u64().is_some_and(|t| t >= 2000)
        },
    )
    .await;
    let s = signals().await;
    let budget = s["learned_kv_tokens"].as_u64().unwrap();
    // never above the engine's real budget; the batch it was learned from fills it
    assert!(budget <= 2500, "{s}");
    assert_eq!(s["kv_cache_usage"].as_f64(), Some(1.0), "{s}");
    let text = gw.metrics_text().await;
    assert_eq!(
        metric(
            &text,
            "sluice_backend_kv_cache_usage_ratio{backend=\"kv-budget-tgi\"}"
        ),
        1.0,
        "{text}"
    );
    for d in direct {
        d.abort();
    }
    // The clients are gone, the engine empties; the budget stays and prices the empty batch.
    eventually(Duration::from_secs(10), "the batch emptied", || async {
        let s = signals().await;
        s["running"].as_f64() == Some(0.0) && s["kv_cache_usage"].as_f64() == Some(0.0)
    })
    .await;
    assert_eq!(signals().await["learned_kv_tokens"].as_u64(), Some(budget));
    gw.stop().await;
}
