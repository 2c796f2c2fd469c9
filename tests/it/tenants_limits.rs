//! Tenants end to end: keys, per-key and per-tenant limits, 429 bodies and headers, token
//! reservation and refunds, streaming usage, usage accounting, reload.

use crate::support;

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use sluice::sim::{Fault, FaultMode, SimConfig, SimKind};
use support::{backend, chat_body, client, get_json, get_text, header, sse_data, TestGateway};

fn key_block(name: &str, tenant: &str, extra: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    (
        key,
        format!(
            "\n[[keys]]\nname = \"{name}\"\ntenant = \"{tenant}\"\nhash = \"{hash}\"\n{extra}\n"
        ),
    )
}

async fn fast_sim() -> sluice::sim::SimHandle {
    sluice::sim::spawn(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(0.0)
            .output_tokens(20, 20),
    )
    .await
    .unwrap()
}

async fn post(
    c: &reqwest::Client,
    gw: &TestGateway,
    key: &str,
    body: serde_json::Value,
) -> reqwest::Response {
    c.post(gw.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_window_exact_under_concurrency() {
    let sim = fast_sim().await;
    let (key, block) = key_block("alice", "team", "requests_per_minute = 20");
    let gw = TestGateway::start_healthy(&format!(
        "{}{block}",
        backend("b", "vllm", &sim.url(), &["m"])
    ))
    .await;
    let c = client();
    let started = Instant::now();
    let answers = join_all((0..80).map(|_| post(&c, &gw, &key, chat_body("m", false, 5)))).await;
    let burst = started.elapsed();
    let ok = answers.iter().filter(|r| r.status() == 200).count();
    let limited: Vec<_> = answers.iter().filter(|r| r.status() == 429).collect();
    // 20 per 60 s refill one every 3 s: a burst well under that admits exactly 20 (±1).
    assert!(burst < Duration::from_secs(3), "burst took {burst:?}");
    assert!((20..=21).contains(&ok), "admitted {ok}");
    assert_eq!(ok + limited.len(), 80);
    for r in &answers {
        let h = r.headers();
        assert_eq!(h["x-ratelimit-limit-requests"], "20");
        assert!(h.contains_key("x-ratelimit-remaining-requests"));
        assert!(h.contains_key("x-ratelimit-reset-requests"));
    }
    let r = limited[0];
    let after: u64 = header(r, "retry-after").parse().unwrap();
    assert!((1..=3).contains(&after), "retry-after {after}");
    assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "0");
    let r = post(&c, &gw, &key, chat_body("m", false, 5)).await;
    assert_eq!(r.status(), 429);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "requests");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("Rate limit reached for m"), "{msg}");
    assert!(
        msg.contains("Limit 20") && msg.contains("Please try again in"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_limit_is_a_team_total_and_short_windows_refill() {
    let sim = fast_sim().await;
    let (ka, a) = key_block("a", "team", "requests_per_minute = 100");
    let (kb, b) = key_block("b", "team", "");
    let gw = TestGateway::start_healthy(&format!(
        "{}{a}{b}\n[limits]\nwindow = \"1s\"\n[[tenants]]\nname = \"team\"\nrequests_per_minute = 6\n",
        backend("b", "vllm", &sim.url(), &["m"])
    ))
    .await;
    let c = client();
    let answers = join_all((0..30).map(|i| {
        let k = if i % 2 == 0 { ka.clone() } else { kb.clone() };
        let c = c.clone();
        let gw = &gw;
        async move { post(&c, gw, &k, chat_body("m", false, 5)).await.status() }
    }))
    .await;
    let ok = answers.iter().filter(|s| s.as_u16() == 200).count();
    assert!((6..=7).contains(&ok), "team admitted {ok}");
    // The 1 s window refills: within a second one more request passes.
    support::eventually(Duration::from_secs(2), "refill", || {
        let c = c.clone();
        let ka = ka.clone();
        let gw = &gw;
        async move { post(&c, gw, &ka, chat_body("m", false, 5)).await.status() == 200 }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_burst_bounded_and_failures_refunded() {
    // Real timing, so the whole burst is in flight together (nothing reconciled yet).
    let sim = sluice::sim::spawn(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(1.0)
            .output_tokens(20, 20),
    )
    .await
    .unwrap();
    let (key, block) = key_block("t", "t", "tokens_per_minute = 1000");
    let gw = TestGateway::start_healthy(&format!(
        "{}{block}\n[routing]\nmax_attempts = 1\n",
        backend("b", "vllm", &sim.url(), &["m"])
    ))
    .await;
    let c = client();
    // Each request reserves its prompt estimate + max_tokens 300: at most 3 fit in 1000.
    let answers = join_all((0..20).map(|_| post(&c, &gw, &key, chat_body("m", false, 300)))).await;
    let mut ok = 0;
    let mut used = 0u64;
    for r in answers {
        if r.status() == 200 {
            ok += 1;
            let v: serde_json::Value = r.json().await.unwrap();
            used += v["usage"]["total_tokens"].as_u64().unwrap();
        } else {
            assert_eq!(r.status(), 429);
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "tokens");
        }
    }
    assert_eq!(ok, 3, "admitted {ok}");
    assert!(used <= 1000 + 310, "used {used}");
    // Reconciled: the real usage was ~30 tokens each, so the rest came back.
    let r = post(&c, &gw, &key, chat_body("m", false, 300)).await;
    assert_eq!(r.status(), 200);
    let remaining: u64 = header(&r, "x-ratelimit-remaining-tokens").parse().unwrap();
    assert!(remaining >= 300, "remaining {remaining}");

    // A backend error refunds the whole reservation: 10 failures in a row never hit the limit.
    sim.set_fault(Fault::mode(FaultMode::ErrorRate)).unwrap();
    for i in 0..10 {
        let r = post(&c, &gw, &key, chat_body("m", false, 300)).await;
        assert!(r.status().is_server_error(), "request {i}: {}", r.status());
        assert!(r.headers().contains_key("x-ratelimit-remaining-tokens"));
    }
    sim.set_fault(Fault::healthy()).unwrap();
    // (the failures ejected the backend for a moment; once back, the key is not limited)
    let (c2, k2) = (c.clone(), key.clone());
    let gw_ref = &gw;
    support::eventually(Duration::from_secs(5), "served again", move || {
        let (c, k) = (c2.clone(), k2.clone());
        async move {
            let s = post(&c, gw_ref, &k, chat_body("m", false, 300))
                .await
                .status();
            assert_ne!(s, 429, "reservations of failed requests were not refunded");
            s == 200
        }
    })
    .await;

    // Larger than the limit can ever allow: a clear 429 without Retry-After.
    let r = post(&c, &gw, &key, chat_body("m", false, 5000)).await;
    assert_eq!(r.status(), 429);
    assert!(!r.headers().contains_key("retry-after"));
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Request too large"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_usage_stripped_or_kept_and_always_counted() {
    let sim = fast_sim().await;
    let (key, block) = key_block("s", "streamers", "tokens_per_minute = 100000");
    let gw = TestGateway::start_healthy(&format!(
        "{}{block}",
        backend("gpu", "vllm", &sim.url(), &["m"])
    ))
    .await;
    let c = client();
    // Did not ask: no usage chunk reaches the client.
    let r = post(&c, &gw, &key, chat_body("m", true, 50)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-ratelimit-remaining-tokens"));
    let text = r.text().await.unwrap();
    let events = sse_data(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    for e in &events {
        assert!(!e.contains("\"usage\":{"), "unexpected usage chunk: {e}");
    }
    // Asked: the usage chunk arrives unchanged.
    let mut body = chat_body("m", true, 50);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let text = post(&c, &gw, &key, body).await.text().await.unwrap();
    let usage_chunk = sse_data(&text)
        .into_iter()
        .find(|e| e.contains("\"usage\":{") && e.contains("\"choices\":[]"))
        .expect("usage chunk");
    let v: serde_json::Value = serde_json::from_str(&usage_chunk).unwrap();
    let asked_total = v["usage"]["total_tokens"].as_u64().unwrap();
    assert!(asked_total > 0);

    // Both were counted from the backend's usage.
    let gw_ref = &gw;
    let c2 = c.clone();
    support::eventually(Duration::from_secs(3), "usage counted", move || {
        let c = c2.clone();
        async move {
            let v: serde_json::Value = get_json(&c, gw_ref.admin_url("/admin/usage")).await;
            let t = &v["tenants"]["streamers"];
            t["requests"] == 2 && t["total_tokens"].as_u64().unwrap_or(0) > asked_total
        }
    })
    .await;
    let v: serde_json::Value = get_json(&c, gw.admin_url("/admin/usage")).await;
    assert_eq!(v["rows"][0]["backend"], "gpu");
    assert_eq!(v["rows"][0]["key"], "s");
    assert_eq!(v["rows"][0]["model"], "m");
    let metrics = get_text(&c, gw.admin_url("/metrics")).await;
    // This gateway's own series (backend `gpu` is this test's alone): the recorder is
    // process-wide.
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sluice_usage_completion_tokens_total")
                && l.contains("backend=\"gpu\"")),
        "metrics missing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limit_released_on_end() {
    let sim = sluice::sim::spawn(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(1.0)
            .output_tokens(40, 40),
    )
    .await
    .unwrap();
    let (key, block) = key_block("c", "c", "max_concurrent = 2");
    let gw = TestGateway::start_healthy(&format!(
        "{}{block}",
        backend("b", "vllm", &sim.url(), &["m"])
    ))
    .await;
    let c = client();
    let s1 = post(&c, &gw, &key, chat_body("m", true, 40)).await;
    let s2 = post(&c, &gw, &key, chat_body("m", true, 40)).await;
    assert_eq!((s1.status().as_u16(), s2.status().as_u16()), (200, 200));
    let r = post(&c, &gw, &key, chat_body("m", false, 5)).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    drop(s1); // client goes away: its slot is released
    let _ = s2.text().await;
    let (c2, k2) = (c.clone(), key.clone());
    let gw_ref = &gw;
    support::eventually(Duration::from_secs(5), "slots released", move || {
        let (c, k) = (c2.clone(), k2.clone());
        async move {
            post(&c, gw_ref, &k, chat_body("m", false, 5))
                .await
                .status()
                == 200
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_revokes_keys_keeps_counters_and_inflight_streams() {
    let sim = sluice::sim::spawn(
        SimConfig::new(SimKind::Vllm, vec!["m".into(), "secret".into()])
            .speed(1.0)
            .output_tokens(30, 30),
    )
    .await
    .unwrap();
    let (ka, a) = key_block("a", "a", "requests_per_minute = 3\nmodels = [\"m\"]");
    let (kb, b) = key_block("b", "b", "");
    let base = backend("b", "vllm", &sim.url(), &["m", "secret"]);
    let gw = TestGateway::start_healthy(&format!("{base}{a}{b}")).await;
    let c = client();
    let r = post(&c, &gw, &ka, chat_body("secret", false, 5)).await;
    assert_eq!(r.status(), 403);
    assert_eq!(
        post(&c, &gw, &ka, chat_body("m", false, 5)).await.status(),
        200
    );
    let inflight = post(&c, &gw, &kb, chat_body("m", true, 30)).await;
    assert_eq!(inflight.status(), 200);

    // Reload: b revoked, a kept (with its count), disallowed models hidden.
    let next = sluice::config::from_str(
        &format!("{base}{a}\n[auth]\nhide_disallowed_models = true\n"),
        "test",
    )
    .unwrap();
    let t0 = Instant::now();
    gw.gw.reload(next);
    assert_eq!(
        post(&c, &gw, &kb, chat_body("m", false, 5)).await.status(),
        401
    );
    assert!(t0.elapsed() < Duration::from_secs(1));
    // The stream that started before the reload finishes normally.
    let text = inflight.text().await.unwrap();
    assert_eq!(sse_data(&text).last().map(String::as_str), Some("[DONE]"));
    let r = post(&c, &gw, &ka, chat_body("secret", false, 5)).await;
    assert_eq!(r.status(), 404);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    // a used 1 of 3 before the reload: 2 more, then 429.
    let codes: Vec<u16> = join_all((0..4).map(|_| post(&c, &gw, &ka, chat_body("m", false, 5))))
        .await
        .iter()
        .map(|r| r.status().as_u16())
        .collect();
    assert_eq!(codes.iter().filter(|s| **s == 200).count(), 2, "{codes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daily_budget_refuses_with_insufficient_quota() {
    let sim = fast_sim().await;
    let (key, block) = key_block("d", "d", "daily_tokens = 500");
    let gw = TestGateway::start_healthy(&format!(
        "{}{block}",
        backend("b", "vllm", &sim.url(), &["m"])
    ))
    .await;
    let c = client();
    assert_eq!(
        post(&c, &gw, &key, chat_body("m", false, 300))
            .await
            .status(),
        200
    );
    // ~30 used of 500 after reconciliation: one more 300 fits, then the reservations do not.
    assert_eq!(
        post(&c, &gw, &key, chat_body("m", false, 300))
            .await
            .status(),
        200
    );
    let r = post(&c, &gw, &key, chat_body("m", false, 450)).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "insufficient_quota");
}
