//! The continuous-batching timing model: TTFT, queueing, batch limit, KV capacity, prefix cache.
//! Comparisons are relative and generous; every wait polls a condition with a deadline.

use std::time::{Duration, Instant};

use crate::support::poll;
use crate::support::sim::*;
use serde_json::{json, Value};
use sluice::sim::{SimConfig, SimKind, Timing};

fn timing(prefill_us: u64, decode_us: u64) -> Timing {
    Timing {
        prefill_per_token: Duration::from_micros(prefill_us),
        decode_base: Duration::from_micros(decode_us),
        decode_per_seq: Duration::from_micros(10),
        ..Default::default()
    }
}

fn words(n: usize) -> String {
    // " the" is one token per word
    "the ".repeat(n)
}

/// Time to the first streamed chunk of a chat completion.
async fn ttft(c: &reqwest::Client, url: &str, prompt: &str, max_tokens: u32) -> Duration {
    let t = Instant::now();
    let mut r = post_json(
        c,
        format!("{url}/v1/chat/completions"),
        &json!({"messages":[{"role":"user","content":prompt}],"max_tokens":max_tokens,"stream":true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap();
    let elapsed = t.elapsed();
    assert!(first.is_some());
    while r.chunk().await.unwrap().is_some() {}
    elapsed
}

fn long_request(
    c: &reqwest::Client,
    url: &str,
    prompt: &str,
    max_tokens: u32,
) -> tokio::task::JoinHandle<u16> {
    let c = c.clone();
    let url = format!("{url}/v1/chat/completions");
    let body = json!({"messages":[{"role":"user","content":prompt}],"max_tokens":max_tokens});
    tokio::spawn(async move {
        c.post(url)
            .json(&body)
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    })
}

async fn wait_state(c: &reqwest::Client, url: &str, f: impl Fn(&Value) -> bool) -> Value {
    poll(Duration::from_secs(10), "the simulator's state", || {
        let c = c.clone();
        let url = url.to_string();
        let f = &f;
        async move {
            let s = state(&c, &url).await;
            f(&s).then_some(s)
        }
    })
    .await
}

#[tokio::test]
async fn ttft_grows_with_prompt_length() {
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| {
        c.timing(timing(300, 1000)).max_model_len(100_000)
    })
    .await;
    let c = client();
    let short = ttft(&c, &sim.url(), "hi", 2).await;
    let long = ttft(&c, &sim.url(), &words(1500), 2).await;
    // 1500 tokens × 300 µs ≈ 450 ms of prefill
    assert!(
        long > short + Duration::from_millis(250),
        "short {short:?} long {long:?}"
    );
}

#[tokio::test]
async fn ttft_grows_with_queue_depth_and_batch_limit_holds() {
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| {
        c.timing(timing(10, 2000)).max_num_seqs(2)
    })
    .await;
    let c = client();
    let url = sim.url();
    let alone = ttft(&c, &url, "probe", 2).await;
    let bg: Vec<_> = (0..6)
        .map(|i| long_request(&c, &url, &format!("bg {i}"), 100))
        .collect();
    let s = wait_state(&c, &url, |s| s["running"] == 2 && s["waiting"] == 4).await;
    assert_eq!(s["models"][0]["running"], 2);
    // the batch limit holds while the queue drains; /metrics agrees
    for _ in 0..5 {
        let s = state(&c, &url).await;
        assert!(s["running"].as_u64().unwrap() <= 2);
        let m = get_text(&c, format!("{url}/metrics")).await;
        let line = m
            .lines()
            .find(|l| l.starts_with("vllm:num_requests_running{"))
            .unwrap();
        let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(v <= 2.0, "{line}");
    }
    let m = get_text(&c, format!("{url}/metrics")).await;
    assert!(
        m.lines()
            .any(|l| l.starts_with("vllm:num_requests_waiting{") && !l.ends_with(" 0.0")),
        "{m}"
    );
    let queued = ttft(&c, &url, "probe", 2).await;
    // at least two rounds of 100 steps × 2 ms stand before the probe
    assert!(
        queued > alone + Duration::from_millis(150),
        "alone {alone:?} queued {queued:?}"
    );
    for h in bg {
        assert_eq!(h.await.unwrap(), 200);
    }
}

#[tokio::test]
async fn requests_wait_while_the_kv_cache_is_full() {
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| {
        c.timing(timing(10, 2000))
            .max_num_seqs(8)
            .kv_capacity_tokens(120)
            .max_model_len(120)
    })
    .await;
    let c = client();
    let url = sim.url();
    // each request reserves prompt + 80 tokens: only one fits in 120
    let bg: Vec<_> = (0..3)
        .map(|i| long_request(&c, &url, &format!("kv {i}"), 80))
        .collect();
    let s = wait_state(&c, &url, |s| s["running"] == 1 && s["waiting"] == 2).await;
    assert!(s["models"][0]["kv_usage"].as_f64().unwrap() > 0.0);
    assert!(s["models"][0]["kv_reserved_tokens"].as_u64().unwrap() <= 120);
    let m = get_text(&c, format!("{url}/metrics")).await;
    let line = m
        .lines()
        .find(|l| l.starts_with("vllm:kv_cache_usage_perc{"))
        .unwrap();
    let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(v > 0.0 && v <= 1.0, "{line}");
    for h in bg {
        assert_eq!(h.await.unwrap(), 200);
    }
    let s = state(&c, &url).await;
    assert_eq!(s["running"], 0);
    assert_eq!(s["models"][0]["kv_used_tokens"], 0);
}

#[tokio::test]
async fn a_repeated_prefix_hits_the_cache_and_prefills_faster() {
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| {
        c.timing(timing(1000, 1000)).max_model_len(10_000)
    })
    .await;
    let c = client();
    let url = sim.url();
    let prompt = words(400);
    let cold = ttft(&c, &url, &prompt, 1).await;
    let warm = ttft(&c, &url, &prompt, 1).await;
    assert!(warm * 2 < cold, "cold {cold:?} warm {warm:?}");
    let s = state(&c, &url).await;
    let hits = s["models"][0]["prefix_cache_hits"].as_u64().unwrap();
    assert!(hits >= 384, "hits {hits}");
    assert_eq!(s["counters"]["prefix_cache_hits"].as_u64().unwrap(), hits);
    let m = get_text(&c, format!("{url}/metrics")).await;
    let line = m
        .lines()
        .find(|l| l.starts_with("vllm:prefix_cache_hits_total{"))
        .unwrap();
    assert_eq!(
        line,
        format!("vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"m\"}} {hits}.0")
    );
}

#[tokio::test]
async fn tokens_arrive_one_decode_step_apart() {
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| {
        c.timing(timing(10, 20_000))
    })
    .await;
    let c = client();
    let t = Instant::now();
    let v: Value = post_for_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"messages":[{"role":"user","content":"x"}],"max_tokens":10}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 10);
    // 10 steps of 20 ms
    assert!(
        t.elapsed() >= Duration::from_millis(180),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test]
async fn speed_zero_answers_at_once_even_for_long_answers() {
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| c.speed(0.0)).await;
    let c = client();
    let t = Instant::now();
    let v: Value = post_for_json(
        &c,
        format!("{}/v1/chat/completions", sim.url()),
        &json!({"messages":[{"role":"user","content":"x"}],"max_tokens":2000}),
    )
    .await;
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 16);
    assert!(t.elapsed() < Duration::from_secs(2));
}

/// vLLM reports `num_requests_waiting` from its scheduler after each step: a request that
/// arrives during a step and joins the batch at the next one is never counted as waiting
/// there (a gateway learning batch limits from "running while others wait" would read a batch
/// with room as full). `/sim/state` counts it at once.
#[tokio::test]
async fn a_request_arriving_mid_step_is_not_reported_waiting_by_vllm_metrics() {
    // decode steps of 300 ms, room for 8
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| {
        c.timing(timing(10, 300_000)).max_num_seqs(8)
    })
    .await;
    let c = client();
    let url = sim.url();
    let first = long_request(&c, &url, "first", 20);
    wait_state(&c, &url, |s| s["running"] == 1).await;
    let second = long_request(&c, &url, "second", 2);
    wait_state(&c, &url, |s| s["waiting"] == 1).await;
    let m = get_text(&c, format!("{url}/metrics")).await;
    let line = m
        .lines()
        .find(|l| l.starts_with("vllm:num_requests_waiting{"))
        .expect("the waiting gauge");
    assert!(line.ends_with(" 0.0"), "{line}");
    assert_eq!(second.await.unwrap(), 200);
    assert_eq!(first.await.unwrap(), 200);
}
